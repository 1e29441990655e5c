//! `clone3` as `posix_spawn` uses `clone`: the child shares our memory (`CLONE_VM`) on a stack
//! of its own, and this thread waits until it has called `execve` or ended (`CLONE_VFORK`).
//! Nothing of our address space is copied, and nothing of it is write-protected for a child
//! that only execs: a fork of the supervisor copied its page tables, and every page it wrote
//! after faulted once. `CLONE_INTO_CGROUP` is kept, so the child is created in its cgroup.
//!
//! The child runs on our memory while our other threads go on: it calls nothing that allocates,
//! locks or unwinds, only system calls on data built before the clone. Every signal is blocked
//! in this thread across the clone, so that no handler of ours runs in the child before it has
//! reset every disposition to its default; it unblocks them itself after that.
//!
//! x86-64 only: the child starts on its new stack at the instruction after `syscall`, so the
//! entry is a few lines of assembly. Elsewhere [`clone3`] says `ENOSYS` and the caller forks.

use std::ffi::c_void;

use nix::errno::Errno;
use nix::libc;
use nix::sys::signal::{SigSet, SigmaskHow, pthread_sigmask};

/// The child's stack: what `exec_child` and the system calls it makes need, with room to spare.
const STACK: usize = 64 * 1024;

/// The guard page below it.
const GUARD: usize = 4096;

/// The child's stack, mapped for it with a guard page below: a child that overran it would
/// fault there, not write over our memory.
struct Stack {
    /// The mapping's start: the guard page.
    map: *mut c_void,
    /// The first usable byte, above the guard page.
    base: usize,
}

impl Stack {
    fn new() -> Result<Self, Errno> {
        // SAFETY: a fresh anonymous mapping, ours alone.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                STACK + GUARD,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(Errno::last());
        }
        let stack = Self {
            map,
            base: map as usize + GUARD,
        };
        // SAFETY: the first page of the mapping just made.
        if unsafe { libc::mprotect(map, GUARD, libc::PROT_NONE) } != 0 {
            return Err(Errno::last());
        }
        Ok(stack)
    }

    /// The top, 16-byte aligned as the ABI wants it before a call.
    fn top(&self) -> usize {
        (self.base + STACK) & !15
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, no longer used: the child has exec'd or ended.
        unsafe { libc::munmap(self.map, STACK + GUARD) };
    }
}

/// Clone with `args` (its stack set here, `CLONE_VM | CLONE_VFORK` added) and run
/// `child(arg)` in the child, which must end in `execve` or `_exit`. Returns the child's pid
/// once it has done either.
///
/// # Safety
/// `child` must be async-signal-safe in the strict sense of `vfork`: no allocation, no lock,
/// no unwinding, no return; `arg` must stay valid until this returns.
pub(crate) unsafe fn clone3(
    args: &mut libc::clone_args,
    child: extern "C" fn(*mut c_void) -> !,
    arg: *mut c_void,
) -> Result<libc::pid_t, Errno> {
    let stack = Stack::new()?;
    let (base, top) = (stack.base, stack.top());
    args.flags |= (libc::CLONE_VM | libc::CLONE_VFORK) as u64;
    args.stack = base as u64;
    args.stack_size = (top - base) as u64;
    let mut old = SigSet::empty();
    pthread_sigmask(
        SigmaskHow::SIG_SETMASK,
        Some(&SigSet::all()),
        Some(&mut old),
    )?;
    // SAFETY: the caller's contract; the stack lives until after the child has exec'd or ended.
    let rc = unsafe { raw(args, child, arg) };
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None)?;
    drop(stack);
    if rc < 0 {
        Err(Errno::from_raw(-rc as i32))
    } else {
        Ok(rc as libc::pid_t)
    }
}

#[cfg(target_arch = "x86_64")]
unsafe fn raw(
    args: &libc::clone_args,
    child: extern "C" fn(*mut c_void) -> !,
    arg: *mut c_void,
) -> libc::c_long {
    let ret: libc::c_long;
    // The pid, or the errno negated as the kernel returns it.
    // SAFETY: clone3 returns twice. Here (rax = pid or -errno) we go on as after any system
    // call. In the child (rax = 0) rsp is the new stack's top, every other register as it was:
    // it calls `child(arg)`, which never returns.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r12",
            "call r13",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => ret,
            in("rdi") args as *const libc::clone_args,
            in("rsi") std::mem::size_of::<libc::clone_args>(),
            in("r12") arg,
            in("r13") child,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn raw(
    _args: &libc::clone_args,
    _child: extern "C" fn(*mut c_void) -> !,
    _arg: *mut c_void,
) -> libc::c_long {
    -libc::c_long::from(libc::ENOSYS)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use nix::sys::wait::{WaitStatus, waitpid};
    use nix::unistd::Pid;

    extern "C" fn exit_with(arg: *mut c_void) -> ! {
        // SAFETY: _exit only.
        unsafe { libc::_exit(arg as usize as i32) }
    }

    extern "C" fn exec_true(_: *mut c_void) -> ! {
        let argv = [c"true".as_ptr(), std::ptr::null()];
        let envp = [std::ptr::null()];
        // SAFETY: NUL-terminated strings in static memory.
        unsafe {
            libc::execve(c"/bin/true".as_ptr(), argv.as_ptr(), envp.as_ptr());
            libc::_exit(127)
        }
    }

    fn args() -> libc::clone_args {
        // SAFETY: plain data.
        let mut args: libc::clone_args = unsafe { std::mem::zeroed() };
        args.exit_signal = libc::SIGCHLD as u64;
        args
    }

    #[test]
    fn the_child_runs_on_its_own_stack_and_this_thread_goes_on_once_it_has_ended_or_exec_d() {
        let mut before = SigSet::empty();
        pthread_sigmask(SigmaskHow::SIG_SETMASK, None, Some(&mut before)).unwrap();
        // SAFETY: the children only _exit or execve.
        let ended = unsafe { clone3(&mut args(), exit_with, 7 as *mut c_void) }.unwrap();
        let ran = unsafe { clone3(&mut args(), exec_true, std::ptr::null_mut()) }.unwrap();
        assert_eq!(
            waitpid(Pid::from_raw(ended), None).unwrap(),
            WaitStatus::Exited(Pid::from_raw(ended), 7)
        );
        assert_eq!(
            waitpid(Pid::from_raw(ran), None).unwrap(),
            WaitStatus::Exited(Pid::from_raw(ran), 0)
        );
        let mut after = SigSet::empty();
        pthread_sigmask(SigmaskHow::SIG_SETMASK, None, Some(&mut after)).unwrap();
        assert_eq!(before, after, "this thread's signal mask is as it was");
    }
}
