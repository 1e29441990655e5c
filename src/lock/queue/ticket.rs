//! A place in a named lock's queue: its class, its sequence number and its owner, written as
//! the ticket file's name so that names sort in queue order.
//!
//! Floor: backends (docs/architecture.md): imports the floors below and the other backends, never a
//! command.

use crate::config::Class;

/// A place in the queue; its file name is `rank-seq-pid`, so names sort in queue order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub(crate) struct Ticket {
    pub class: Class,
    pub seq: u64,
    pub pid: i32,
}

impl Ticket {
    pub(crate) fn file_name(&self) -> String {
        format!("{}-{:012}-{}", self.class.rank(), self.seq, self.pid)
    }

    /// Parse a queue entry's name; anything else in the directory is not a ticket.
    pub(crate) fn parse(name: &str) -> Option<Self> {
        let mut parts = name.split('-');
        let class = match parts.next()? {
            "0" => Class::Fast,
            "1" => Class::Normal,
            _ => return None,
        };
        let seq = parts.next()?;
        let pid = parts.next()?;
        // Only canonical names are tickets: a ticket is removed by the name it formats to, so
        // `1-…-01` taken for pid 1 could never be removed and would wedge the queue.
        if parts.next().is_some()
            || seq.len() != 12
            || !seq.bytes().all(|b| b.is_ascii_digit())
            || pid.is_empty()
            || pid.starts_with('0')
            || !pid.bytes().all(|b| b.is_ascii_digit())
        {
            return None;
        }
        let pid: i32 = pid.parse().ok().filter(|p| *p > 0)?;
        Some(Self {
            class,
            seq: seq.parse().ok()?,
            pid,
        })
    }

    /// "12 (normal, pid 4242)"
    pub(crate) fn describe(&self) -> String {
        format!("{} ({}, pid {})", self.seq, self.class.as_str(), self.pid)
    }
}

/// A ticket seen in the queue directory, with its age.
#[derive(Debug, Clone, serde::Serialize)]
pub(crate) struct QueuedTicket {
    pub ticket: Ticket,
    pub age_s: u64,
}
