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
    // Never read from here: memory for the child to push on, untouched until it does.
    let mut stack: Vec<u8> = Vec::with_capacity(STACK);
    let base = stack.as_mut_ptr() as usize;
    // The top, 16-byte aligned as the ABI wants it before a call.
    let top = (base + STACK) & !15;
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
    let errno = Errno::last();
    pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None)?;
    drop(stack);
    if rc < 0 {
        Err(errno)
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
    if ret < 0 {
        Errno::set_raw(-ret as i32);
        return -1;
    }
    ret
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn raw(
    _args: &libc::clone_args,
    _child: extern "C" fn(*mut c_void) -> !,
    _arg: *mut c_void,
) -> libc::c_long {
    Errno::set_raw(libc::ENOSYS);
    -1
}
