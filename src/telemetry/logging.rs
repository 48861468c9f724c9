//! Logging: the settings read from the environment, the subscriber, and the
//! writer it logs through.
//!
//! Logging must never affect a request or a signal. Log lines go to stderr
//! through a [`LossyWriter`]: when stderr is gone (a closed pipe because
//! `tee` or `logger` exited, a restarted journald) a write fails with `EPIPE`
//! (Rust ignores `SIGPIPE`), and the writer counts the failure and reports
//! success, so nothing downstream (tracing-subscriber's own error report, an
//! `eprintln!` that would panic) ever sees it. The count is
//! [`write_errors`].
//!
//! Settings, read once at start ([`LogSettings::from_env`]); a bad value is an
//! error naming the variable, never a silent fallback:
//! - `IDEMGATE_LOG`: a tracing `EnvFilter` (e.g. `info,idemgate=debug`);
//!   unset or empty: `info`.
//! - `IDEMGATE_LOG_FORMAT`: `text` or `json`, in any case; unset or empty:
//!   `text`. Text has ANSI colour only when stderr is a terminal.
//!
//! Access lines (one per request) skip the subscriber's formatter: the
//! `idemgate` binary formats them by hand ([`line_format`]) and collects
//! them in one batch ([`batched`]) written when it holds 32 KiB, every
//! 100 ms, and at exit ([`flush`]), as nginx's `access_log ... buffer=
//! flush=` does. A process killed with SIGKILL loses at most the last
//! 100 ms of access lines; other log lines are written as they happen.
//!
//! [`ErrorChain`] prints an error and its sources once each, PostgreSQL
//! server errors with their SQLSTATE.

use std::error::Error;
use std::ffi::OsString;
use std::fmt;
use std::io::{self, IsTerminal as _, Write as _};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::MakeWriter;

/// The variable holding the filter.
pub const LOG_ENV: &str = "IDEMGATE_LOG";
/// The variable holding the format.
pub const LOG_FORMAT_ENV: &str = "IDEMGATE_LOG_FORMAT";
/// The filter when `IDEMGATE_LOG` is unset or empty.
pub const DEFAULT_FILTER: &str = "info";

/// Log lines the process could not write to stderr (for a later
/// `idemgate_log_write_errors_total` metric).
static WRITE_ERRORS: AtomicU64 = AtomicU64::new(0);

/// How many log lines could not be written since the process started.
pub fn write_errors() -> u64 {
    WRITE_ERRORS.load(Ordering::Relaxed)
}

#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("{LOG_FORMAT_ENV}={value:?} is not a log format: use \"text\" or \"json\"")]
    Format { value: String },
    #[error("{LOG_ENV}={value:?} is not a valid filter ({detail}); example: {LOG_ENV}=info,idemgate=debug")]
    Filter { value: String, detail: String },
    #[error("{var} is not valid UTF-8")]
    NotUnicode { var: &'static str },
    #[error("cannot install the log subscriber: {0}")]
    Install(String),
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, the event's fields at the top level.
    Json,
}

impl LogFormat {
    /// `text` or `json` in any case, surrounding blanks ignored; `None` or an
    /// empty value is the default, `text`.
    pub fn parse(value: Option<&str>) -> Result<LogFormat, LoggingError> {
        let v = value.map(str::trim).unwrap_or_default();
        if v.is_empty() || v.eq_ignore_ascii_case("text") {
            Ok(LogFormat::Text)
        } else if v.eq_ignore_ascii_case("json") {
            Ok(LogFormat::Json)
        } else {
            Err(LoggingError::Format { value: value.unwrap_or_default().to_owned() })
        }
    }
}

/// Parses a filter; `None` or an empty value is [`DEFAULT_FILTER`].
pub fn parse_filter(value: Option<&str>) -> Result<EnvFilter, LoggingError> {
    let v = value.map(str::trim).filter(|v| !v.is_empty()).unwrap_or(DEFAULT_FILTER);
    EnvFilter::builder()
        .parse(v)
        .map_err(|e| LoggingError::Filter { value: value.unwrap_or_default().to_owned(), detail: ErrorChain(&e).to_string() })
}

/// What the subscriber is built from.
#[derive(Debug)]
pub struct LogSettings {
    pub format: LogFormat,
    pub filter: EnvFilter,
}

impl LogSettings {
    /// Reads `IDEMGATE_LOG` and `IDEMGATE_LOG_FORMAT`.
    pub fn from_env() -> Result<LogSettings, LoggingError> {
        LogSettings::from_lookup(|name| std::env::var_os(name))
    }

    /// Reads the settings through `lookup` (the environment, or a test's map).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<OsString>) -> Result<LogSettings, LoggingError> {
        let var = |name: &'static str| -> Result<Option<String>, LoggingError> {
            lookup(name).map(|v| v.into_string().map_err(|_| LoggingError::NotUnicode { var: name })).transpose()
        };
        let format = LogFormat::parse(var(LOG_FORMAT_ENV)?.as_deref())?;
        let filter = parse_filter(var(LOG_ENV)?.as_deref())?;
        Ok(LogSettings { format, filter })
    }
}

/// Installs the process's subscriber: `settings` on stderr through a
/// [`LossyWriter`], colour only when stderr is a terminal. Access lines are
/// batched from then on, unless they would be coloured.
pub fn init(settings: LogSettings) -> Result<(), LoggingError> {
    let terminal = io::stderr().is_terminal();
    let builder = tracing_subscriber::fmt()
        .with_env_filter(settings.filter)
        .with_writer(LossyWriter::stderr())
        // Write errors never reach the subscriber (the writer swallows them);
        // this keeps it from reporting anything with `eprintln!` regardless.
        .log_internal_errors(false);
    let installed = match settings.format {
        LogFormat::Json => builder.with_ansi(false).json().flatten_event(true).try_init(),
        LogFormat::Text => builder.with_ansi(terminal).try_init(),
    };
    installed.map_err(|e| LoggingError::Install(e.to_string()))?;
    let direct = match settings.format {
        LogFormat::Json => Some(LineFormat::Json),
        LogFormat::Text if !terminal => Some(LineFormat::Text),
        LogFormat::Text => None,
    };
    if let Some(format) = direct {
        let _ = LINE_FORMAT.set(format);
    }
    Ok(())
}

/// The shape of a hand-formatted line (the subscriber's, without colour).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LineFormat {
    Text,
    Json,
}

static LINE_FORMAT: OnceLock<LineFormat> = OnceLock::new();

/// How to format access lines by hand; `None` before [`init`] (a library
/// user's subscriber) or with colour: then they are `tracing` events.
pub fn line_format() -> Option<LineFormat> {
    LINE_FORMAT.get().copied()
}

/// Lines waiting to be written to stderr.
static BATCH: Mutex<Vec<u8>> = Mutex::new(Vec::new());
/// A batch this large is written at once.
const BATCH_BYTES: usize = 32 * 1024;
/// Otherwise the flusher writes it this often.
const FLUSH_EVERY: Duration = Duration::from_millis(100);

/// Whether the flusher thread runs (started by the first batched line).
static FLUSHER: OnceLock<bool> = OnceLock::new();

/// Appends to the batch with `append` (whole lines), writing it out when full.
/// Without a flusher thread (it could not be started) every line is written
/// at once.
pub fn batched(append: impl FnOnce(&mut Vec<u8>)) {
    let flusher = *FLUSHER.get_or_init(|| {
        let spawned = std::thread::Builder::new().name("idemgate-log-flush".into()).spawn(|| {
            loop {
                std::thread::sleep(FLUSH_EVERY);
                flush();
            }
        });
        spawned.is_ok()
    });
    let mut batch = BATCH.lock().unwrap_or_else(PoisonError::into_inner);
    append(&mut batch);
    if !flusher || batch.len() >= BATCH_BYTES {
        write_batch(&mut batch);
    }
}

/// Writes what the batch holds (the flusher, and before the process exits).
pub fn flush() {
    let mut batch = BATCH.lock().unwrap_or_else(PoisonError::into_inner);
    if !batch.is_empty() {
        write_batch(&mut batch);
    }
}

/// One `write` for the whole batch, under the batch's lock so that batches
/// keep their order; a failure drops the batch and counts its lines.
fn write_batch(batch: &mut Vec<u8>) {
    if io::stderr().lock().write_all(batch).is_err() {
        let lines = batch.iter().filter(|&&b| b == b'\n').count();
        WRITE_ERRORS.fetch_add(lines as u64, Ordering::Relaxed);
    }
    batch.clear();
}

/// A [`MakeWriter`] whose writers never fail: a write error is counted and
/// the line dropped. Losing a log line is better than losing a request.
#[derive(Debug, Clone, Copy)]
pub struct LossyWriter<M> {
    inner: M,
    errors: &'static AtomicU64,
}

impl LossyWriter<fn() -> io::Stderr> {
    /// Stderr, counting into [`write_errors`].
    pub fn stderr() -> Self {
        LossyWriter { inner: io::stderr, errors: &WRITE_ERRORS }
    }
}

impl<M> LossyWriter<M> {
    /// Wraps `inner`, counting failed writes in `errors`.
    pub fn new(inner: M, errors: &'static AtomicU64) -> Self {
        LossyWriter { inner, errors }
    }
}

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for LossyWriter<M> {
    type Writer = Lossy<M::Writer>;

    fn make_writer(&'a self) -> Self::Writer {
        Lossy { inner: self.inner.make_writer(), errors: self.errors, failed: false }
    }

    fn make_writer_for(&'a self, meta: &tracing::Metadata<'_>) -> Self::Writer {
        Lossy { inner: self.inner.make_writer_for(meta), errors: self.errors, failed: false }
    }
}

/// One line's writer (see [`LossyWriter`]).
#[derive(Debug)]
pub struct Lossy<W> {
    inner: W,
    errors: &'static AtomicU64,
    /// Once a write of this line failed, the rest of it is dropped too (and
    /// the line counted once).
    failed: bool,
}

impl<W: io::Write> io::Write for Lossy<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if !self.failed && self.inner.write_all(buf).is_err() {
            self.failed = true;
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.failed && self.inner.flush().is_err() {
            self.failed = true;
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// Displays an error and its sources, `outer: inner: innermost`, each once:
/// a source whose text the message so far already ends with (an error that
/// prints its source itself, as `thiserror`'s `{source}` does) is skipped.
/// A PostgreSQL server error shows its severity, message, SQLSTATE, detail
/// and hint on one line.
#[derive(Clone, Copy)]
pub struct ErrorChain<'a>(pub &'a (dyn Error + 'static));

impl fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut text = String::new();
        let mut next = Some(self.0);
        while let Some(e) = next {
            let part = match e.downcast_ref::<tokio_postgres::error::DbError>() {
                Some(db) => db_error_text(db),
                None => e.to_string(),
            };
            if text.is_empty() {
                text = part;
            } else if !part.is_empty() && !text.ends_with(&part) {
                text.push_str(": ");
                text.push_str(&part);
            }
            next = e.source();
        }
        f.write_str(&text)
    }
}

impl fmt::Debug for ErrorChain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// `ERROR: relation "x" does not exist (SQLSTATE 42P01); DETAIL: ...; HINT: ...`
fn db_error_text(db: &tokio_postgres::error::DbError) -> String {
    let mut s = format!("{}: {} (SQLSTATE {})", db.severity(), db.message(), db.code().code());
    if let Some(detail) = db.detail() {
        s.push_str("; DETAIL: ");
        s.push_str(detail);
    }
    if let Some(hint) = db.hint() {
        s.push_str("; HINT: ");
        s.push_str(hint);
    }
    // One log line per event, whatever the server put in its text.
    s.replace('\n', " ")
}

/// Writes `text` to stderr, ignoring failure: for messages that are best
/// effort (a broken stderr must not turn an exit code into a panic).
pub fn stderr_best_effort(text: &str) {
    let mut err = io::stderr().lock();
    let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn format_is_case_insensitive_and_defaults_to_text() {
        assert_eq!(LogFormat::parse(None).unwrap(), LogFormat::Text);
        assert_eq!(LogFormat::parse(Some("")).unwrap(), LogFormat::Text);
        for v in ["json", "JSON", "Json", " json "] {
            assert_eq!(LogFormat::parse(Some(v)).unwrap(), LogFormat::Json, "{v:?}");
        }
        for v in ["text", "TEXT", "Text"] {
            assert_eq!(LogFormat::parse(Some(v)).unwrap(), LogFormat::Text, "{v:?}");
        }
    }

    #[test]
    fn unknown_format_is_an_error_naming_the_variable() {
        for v in ["yaml", "jsonl", "pretty", "1"] {
            let e = LogFormat::parse(Some(v)).unwrap_err().to_string();
            assert!(e.contains("IDEMGATE_LOG_FORMAT") && e.contains(v), "{e}");
        }
    }

    #[test]
    fn filters_parse_or_fail_naming_the_variable() {
        for v in ["info", "info,idemgate=debug", "warn,idemgate::proxy::gateway=trace", "off", "idemgate"] {
            parse_filter(Some(v)).unwrap_or_else(|e| panic!("{v:?}: {e}"));
        }
        assert_eq!(parse_filter(None).unwrap().to_string(), DEFAULT_FILTER);
        assert_eq!(parse_filter(Some("  ")).unwrap().to_string(), DEFAULT_FILTER);
        for v in ["idemgate=loud", "info,=debug=x", "[{"] {
            let e = parse_filter(Some(v)).unwrap_err().to_string();
            assert!(e.contains("IDEMGATE_LOG=") && e.contains(v), "{v:?}: {e}");
        }
    }

    #[test]
    fn settings_come_from_both_variables() {
        let env: HashMap<&str, &str> = HashMap::from([("IDEMGATE_LOG_FORMAT", "JSON"), ("IDEMGATE_LOG", "warn,idemgate=debug")]);
        let s = LogSettings::from_lookup(|k| env.get(k).map(OsString::from)).unwrap();
        assert_eq!(s.format, LogFormat::Json);
        assert_eq!(s.filter.to_string(), "idemgate=debug,warn");

        let bad = HashMap::from([("IDEMGATE_LOG", "idemgate=loud")]);
        let e = LogSettings::from_lookup(|k| bad.get(k).map(OsString::from)).unwrap_err();
        assert!(matches!(e, LoggingError::Filter { .. }), "{e}");
    }

    #[test]
    fn non_utf8_value_is_an_error_naming_the_variable() {
        use std::os::unix::ffi::OsStringExt as _;
        let e = LogSettings::from_lookup(|k| (k == LOG_ENV).then(|| OsString::from_vec(vec![0xff, b'x']))).unwrap_err();
        assert_eq!(e.to_string(), "IDEMGATE_LOG is not valid UTF-8");
    }

    /// A writer whose reader is gone.
    struct BrokenPipe;

    impl io::Write for BrokenPipe {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from(io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> io::Result<()> {
            Err(io::Error::from(io::ErrorKind::BrokenPipe))
        }
    }

    #[test]
    fn lossy_writer_swallows_and_counts_write_errors() {
        static ERRORS: AtomicU64 = AtomicU64::new(0);
        let make = LossyWriter::new(|| BrokenPipe, &ERRORS);
        for _ in 0..3 {
            let mut w = make.make_writer();
            w.write_all(b"a line\n").unwrap();
            w.write_all(b"more of the same line\n").unwrap();
            w.flush().unwrap();
        }
        assert_eq!(ERRORS.load(Ordering::Relaxed), 3, "one failure per line");
    }

    #[test]
    fn a_subscriber_on_a_broken_writer_logs_without_failing() {
        static ERRORS: AtomicU64 = AtomicU64::new(0);
        let subscriber = tracing_subscriber::fmt().with_writer(LossyWriter::new(|| BrokenPipe, &ERRORS)).finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::info!(n = 1, "first");
            tracing::warn!("second");
        });
        assert_eq!(ERRORS.load(Ordering::Relaxed), 2);
    }

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        /// Prints its source itself and also returns it from `source()`.
        #[error("cannot listen on 127.0.0.1:1: {source}")]
        Bind { source: io::Error },
        /// Prints only its own text.
        #[error("opening the store")]
        Open(#[source] io::Error),
    }

    #[test]
    fn chains_print_each_error_once() {
        let e = Outer::Bind { source: io::Error::new(io::ErrorKind::AddrInUse, "Address already in use") };
        assert_eq!(ErrorChain(&e).to_string(), "cannot listen on 127.0.0.1:1: Address already in use");
        let e = Outer::Open(io::Error::new(io::ErrorKind::NotFound, "no such file"));
        assert_eq!(ErrorChain(&e).to_string(), "opening the store: no such file");

        let e = anyhow::Error::new(Outer::Bind { source: io::Error::other("in use") }).context("starting the gateway");
        let chain = ErrorChain(e.as_ref()).to_string();
        assert_eq!(chain, "starting the gateway: cannot listen on 127.0.0.1:1: in use");
    }
}
