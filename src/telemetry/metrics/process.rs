//! The standard `process_*` metrics (CPU seconds, resident memory, open file
//! descriptors, start time), read from `/proc/self` at each scrape, under the
//! names Prometheus' own client libraries use, so existing dashboards work.
//! Off Linux the files are absent and the metrics are left out.
//!
//! Also `idemgate_log_write_errors_total`: log lines lost to a broken stderr
//! (counted by [`crate::telemetry::logging`]).

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Clock ticks per second of `/proc/<pid>/stat` times. The kernel reports
/// them in USER_HZ, which is 100 on every Linux architecture Prometheus'
/// own procfs library supports (it hard-codes the same value); reading it
/// with `sysconf` would need `unsafe`.
const USER_HZ: f64 = 100.0;

#[derive(Debug)]
pub(super) struct ProcessCollector;

/// What one scrape read; `None` where a file was missing or unreadable.
#[derive(Debug, Default, PartialEq)]
pub(super) struct ProcessStats {
    pub cpu_seconds: Option<f64>,
    pub resident_bytes: Option<i64>,
    pub virtual_bytes: Option<i64>,
    pub threads: Option<i64>,
    pub start_time_seconds: Option<f64>,
    pub open_fds: Option<i64>,
    pub max_fds: Option<i64>,
}

impl ProcessStats {
    pub fn read() -> ProcessStats {
        let mut s = ProcessStats::default();
        if let Ok(stat) = std::fs::read_to_string("/proc/self/stat") {
            let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|t| boot_time(&t));
            s.apply_stat(&stat, boot);
        }
        if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
            s.resident_bytes = status_kib(&status, "VmRSS:").map(|k| k * 1024);
        }
        s.open_fds = std::fs::read_dir("/proc/self/fd").ok().map(|d| d.count() as i64);
        s.max_fds = std::fs::read_to_string("/proc/self/limits").ok().and_then(|t| max_open_files(&t));
        s
    }

    /// Fields of `/proc/self/stat` (see proc(5)); the command name may hold
    /// spaces and parentheses, so fields are counted after its last `)`.
    fn apply_stat(&mut self, stat: &str, boot_time: Option<f64>) {
        let Some((_, rest)) = stat.rsplit_once(')') else { return };
        let f: Vec<&str> = rest.split_whitespace().collect();
        // rest starts at field 3 (state): field N is f[N - 3].
        let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        if let (Some(utime), Some(stime)) = (field(14), field(15)) {
            self.cpu_seconds = Some((utime + stime) as f64 / USER_HZ);
        }
        self.threads = field(20).map(|n| n as i64);
        if let (Some(start), Some(boot)) = (field(22), boot_time) {
            self.start_time_seconds = Some(boot + start as f64 / USER_HZ);
        }
        self.virtual_bytes = field(23).map(|n| n as i64);
    }
}

/// `btime` of `/proc/stat`: boot time in seconds since the epoch.
fn boot_time(text: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix("btime ")).and_then(|v| v.trim().parse().ok())
}

/// A `Name:   1234 kB` line of `/proc/self/status`.
fn status_kib(text: &str, name: &str) -> Option<i64> {
    text.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.split_whitespace().next()).and_then(|v| v.parse().ok())
}

/// The soft limit of `Max open files` in `/proc/self/limits`.
fn max_open_files(text: &str) -> Option<i64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line.strip_prefix("Max open files")?.split_whitespace().next()?.parse().ok()
}

fn gauge(encoder: &mut DescriptorEncoder, name: &str, help: &str, value: Option<i64>) -> Result<(), std::fmt::Error> {
    let Some(v) = value else { return Ok(()) };
    let g = ConstGauge::new(v);
    g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = ProcessStats::read();
        if let Some(cpu) = s.cpu_seconds {
            let c = ConstCounter::new(cpu);
            c.encode(encoder.encode_descriptor(
                "process_cpu_seconds",
                "User and system CPU time spent, in seconds",
                None,
                c.metric_type(),
            )?)?;
        }
        gauge(&mut encoder, "process_resident_memory_bytes", "Resident memory size in bytes", s.resident_bytes)?;
        gauge(&mut encoder, "process_virtual_memory_bytes", "Virtual memory size in bytes", s.virtual_bytes)?;
        gauge(&mut encoder, "process_open_fds", "Open file descriptors", s.open_fds)?;
        gauge(&mut encoder, "process_max_fds", "Limit of open file descriptors", s.max_fds)?;
        gauge(&mut encoder, "process_threads", "OS threads", s.threads)?;
        if let Some(start) = s.start_time_seconds {
            let g = ConstGauge::new(start);
            g.encode(encoder.encode_descriptor(
                "process_start_time_seconds",
                "Start time of the process since the Unix epoch, in seconds",
                None,
                g.metric_type(),
            )?)?;
        }
        let c = ConstCounter::new(crate::telemetry::logging::write_errors());
        c.encode(encoder.encode_descriptor(
            "idemgate_log_write_errors",
            "Log lines that could not be written (stderr a closed pipe) and were dropped",
            None,
            c.metric_type(),
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_files() {
        let mut s = ProcessStats::default();
        // A command name with a space and a parenthesis.
        let stat = "4242 (idem gate) x) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 7 0 12345 104857600 2560 18446744073709551615";
        s.apply_stat(stat, Some(1_700_000_000.0));
        assert_eq!(s.cpu_seconds, Some(3.0));
        assert_eq!(s.threads, Some(7));
        assert_eq!(s.start_time_seconds, Some(1_700_000_123.45));
        assert_eq!(s.virtual_bytes, Some(104_857_600));
        assert_eq!(boot_time("cpu  1 2 3\nbtime 1700000000\nprocesses 9\n"), Some(1_700_000_000.0));
        assert_eq!(status_kib("Name:\tidemgate\nVmRSS:\t   20480 kB\n", "VmRSS:"), Some(20480));
        let limits = "Limit                     Soft Limit           Hard Limit           Units\n\
                      Max open files            1024                 1048576              files\n";
        assert_eq!(max_open_files(limits), Some(1024));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn reads_this_process() {
        let s = ProcessStats::read();
        assert!(s.cpu_seconds.is_some() && s.resident_bytes.is_some_and(|b| b > 0), "{s:?}");
        assert!(s.open_fds.is_some_and(|n| n > 0) && s.max_fds.is_some() && s.start_time_seconds.is_some(), "{s:?}");
    }
}
