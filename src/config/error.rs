//! Configuration errors: each names the file and the TOML path it is about.

use std::fmt;

/// One problem found in a configuration file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigIssue {
    /// TOML path of the offending value, e.g. `routes[0].retention`; empty for
    /// the document as a whole (a syntax error before any key).
    pub path: String,
    pub message: String,
}

/// Every problem found in one file; never empty.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigError {
    /// The file the configuration came from, as given (or `<string>` in tests).
    pub file: String,
    pub issues: Vec<ConfigIssue>,
}

impl ConfigError {
    pub fn single(file: &str, path: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError { file: file.to_owned(), issues: vec![ConfigIssue { path: path.into(), message: message.into() }] }
    }

    /// True when some issue is about `path` (exactly); handy in tests.
    pub fn mentions(&self, path: &str) -> bool {
        self.issues.iter().any(|i| i.path == path)
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, issue) in self.issues.iter().enumerate() {
            if n > 0 {
                writeln!(f)?;
            }
            if issue.path.is_empty() {
                write!(f, "{}: {}", self.file, issue.message)?;
            } else {
                write!(f, "{}: {}: {}", self.file, issue.path, issue.message)?;
            }
        }
        Ok(())
    }
}

/// Collects issues while validating, so one run reports all of them.
#[derive(Debug, Default)]
pub(crate) struct Issues {
    pub(crate) list: Vec<ConfigIssue>,
}

impl Issues {
    pub(crate) fn push(&mut self, path: impl Into<String>, message: impl Into<String>) {
        self.list.push(ConfigIssue { path: path.into(), message: message.into() });
    }
}
