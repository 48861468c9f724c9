//! CPU time of a set of processes, from `/proc/<pid>/stat` (utime + stime):
//! sampled around a run, it gives CPU per request, which stays meaningful on
//! a busy machine where requests/s do not.

use std::sync::OnceLock;

/// A set of processes.
#[derive(Debug, Clone, Copy)]
pub enum Cpu {
    /// One process (all its threads).
    Pid(u32),
    /// Every process in a process group (nginx master and workers).
    Group(u32),
    /// A process and its children, including children that exited and were
    /// reaped (PostgreSQL: the postmaster and its backends).
    Tree(u32),
}

impl Cpu {
    /// CPU seconds used so far by the set.
    pub fn seconds(&self) -> f64 {
        let ticks: u64 = match *self {
            Cpu::Pid(pid) => stat(pid).map_or(0, |s| s.own),
            Cpu::Group(pgid) => all().filter(|s| s.pgrp == pgid).map(|s| s.own).sum(),
            Cpu::Tree(pid) => tree_ticks(pid),
        };
        ticks as f64 / ticks_per_second()
    }
}

/// A child reaped between reading the parent and scanning the children would
/// be counted in neither (or, the other way round, in both): retry until the
/// parent's reaped-children time is the same before and after the scan.
fn tree_ticks(pid: u32) -> u64 {
    let reaped = || stat(pid).map(|s| (s.own, s.reaped_children));
    let mut total = 0;
    for _ in 0..20 {
        let Some((own, before)) = reaped() else { return 0 };
        let children: u64 = all().filter(|s| s.ppid == pid).map(|s| s.own).sum();
        total = own + before + children;
        if reaped().is_some_and(|(_, after)| after == before) {
            break;
        }
    }
    total
}

struct Stat {
    ppid: u32,
    pgrp: u32,
    /// utime + stime, in clock ticks.
    own: u64,
    /// cutime + cstime: children that were waited for.
    reaped_children: u64,
}

fn stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after "(comm)": state is index 0, so field N (1-based) is N - 3.
    let f: Vec<&str> = text[text.rfind(')')? + 1..].split_whitespace().collect();
    let num = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok());
    Some(Stat {
        ppid: u32::try_from(num(1)?).ok()?,
        pgrp: u32::try_from(num(2)?).ok()?,
        own: num(11)? + num(12)?,
        reaped_children: num(13)? + num(14)?,
    })
}

fn all() -> impl Iterator<Item = Stat> {
    std::fs::read_dir("/proc").into_iter().flatten().flatten().filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok()).filter_map(stat)
}

/// `getconf CLK_TCK`, else the usual 100.
fn ticks_per_second() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        std::process::Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(100.0)
    })
}
