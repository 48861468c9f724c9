//! The console's files, compiled into the binary: nothing is read from disk
//! or fetched from elsewhere at run time.

/// One file of the console.
#[derive(Debug, Clone, Copy)]
pub struct Asset {
    pub bytes: &'static [u8],
    pub content_type: &'static str,
}

pub const INDEX_HTML: &str = include_str!("assets/index.html");
pub const CONSOLE_JS: &str = include_str!("assets/console.js");
pub const CONSOLE_CSS: &str = include_str!("assets/console.css");

/// The file at `rest` (the path after `/console`), if there is one.
pub fn find(rest: &str) -> Option<Asset> {
    let (bytes, content_type): (&'static str, &'static str) = match rest {
        "/" | "/index.html" => (INDEX_HTML, "text/html; charset=utf-8"),
        "/console.js" => (CONSOLE_JS, "text/javascript; charset=utf-8"),
        "/console.css" => (CONSOLE_CSS, "text/css; charset=utf-8"),
        _ => return None,
    };
    Some(Asset { bytes: bytes.as_bytes(), content_type })
}
