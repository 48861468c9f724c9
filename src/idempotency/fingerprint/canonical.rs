//! RFC 8785 (JCS) serialization of the parsed tree, written into a [`Sink`] so the same
//! code fills a `Vec<u8>` (for [`canonical_json`](super::canonical_json)) or streams
//! straight into the SHA-256 state (for [`fingerprint`](super::fingerprint)).
//!
//! Deviation from JCS, on purpose: integer literals (no fraction, no exponent) of any
//! size are written as their exact decimal value (`-0` as `0`). For |n| <= 2^53 that is
//! byte-for-byte what JCS (ECMAScript `Number.prototype.toString`) produces; beyond 2^53
//! JCS would first round to the nearest double, so `9007199254740993` and
//! `9007199254740992`, or `18446744073709551616` and `18446744073709551617` (distinct
//! ids or amounts) would collide. Floats (any number with a fraction or exponent)
//! follow JCS exactly via `ryu-js`, including `-0.0` -> `0`.

use std::cmp::Ordering;

use serde_json::Value;
use sha2::{Digest, Sha256};

use super::tree::Node;
use super::{FingerprintError, MAX_DEPTH};

/// Where canonical bytes go. Infallible: both implementations only append.
pub(crate) trait Sink {
    fn put(&mut self, bytes: &[u8]);
}

impl Sink for Vec<u8> {
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
}

/// Size of [`HashSink`]'s staging buffer: canonical JSON arrives in many tiny pieces
/// (`"`, `:`, `,`), which are cheaper to batch than to feed one by one to SHA-256.
const HASH_BUF: usize = 512;

/// A SHA-256 state behind a small staging buffer.
pub(crate) struct HashSink {
    hasher: Sha256,
    buf: [u8; HASH_BUF],
    len: usize,
}

impl HashSink {
    pub(crate) fn new() -> Self {
        HashSink { hasher: Sha256::new(), buf: [0; HASH_BUF], len: 0 }
    }

    fn flush(&mut self) {
        if let Some(pending) = self.buf.get(..self.len) {
            self.hasher.update(pending);
        }
        self.len = 0;
    }

    pub(crate) fn finish(mut self) -> [u8; 32] {
        self.flush();
        self.hasher.finalize().into()
    }
}

impl Sink for HashSink {
    fn put(&mut self, bytes: &[u8]) {
        if bytes.len() > HASH_BUF - self.len {
            self.flush();
            if bytes.len() >= HASH_BUF {
                self.hasher.update(bytes);
                return;
            }
        }
        let end = self.len + bytes.len();
        if let Some(dst) = self.buf.get_mut(self.len..end) {
            dst.copy_from_slice(bytes);
            self.len = end;
        } else {
            // Unreachable by the arithmetic above; stay correct rather than panic.
            self.flush();
            self.hasher.update(bytes);
        }
    }
}

/// Orders member names by their UTF-16 code units, as RFC 8785 section 3.2.3 requires.
///
/// UTF-8 byte order equals code point order, which differs from UTF-16 order only when a
/// supplementary character (surrogate pair, 0xD800..) meets a BMP character in
/// U+E000..U+FFFF, so the common ASCII case is decided on the first differing byte.
pub(crate) fn cmp_utf16(a: &str, b: &str) -> Ordering {
    let first_diff = a.bytes().zip(b.bytes()).position(|(x, y)| x != y);
    match first_diff {
        None => a.len().cmp(&b.len()),
        Some(i) => match (a.as_bytes().get(i), b.as_bytes().get(i)) {
            (Some(&x), Some(&y)) if x < 0x80 && y < 0x80 => x.cmp(&y),
            _ => a.encode_utf16().cmp(b.encode_utf16()),
        },
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Writes `s` as a JCS string: only `"` `\` and controls below 0x20 are escaped
/// (`\b \f \n \r \t` by name, the rest as `\u00xx` in lowercase hex); everything else,
/// including U+007F and U+2028, is literal UTF-8.
pub(crate) fn write_str(out: &mut impl Sink, s: &str) {
    out.put(b"\"");
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let named: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            0x0c => b"\\f",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x00..=0x1f => b"",
            _ => continue,
        };
        out.put(bytes.get(start..i).unwrap_or_default());
        if named.is_empty() {
            let hex = [b'\\', b'u', b'0', b'0', HEX[usize::from(b >> 4)], HEX[usize::from(b & 0x0f)]];
            out.put(&hex);
        } else {
            out.put(named);
        }
        start = i + 1;
    }
    out.put(bytes.get(start..).unwrap_or_default());
    out.put(b"\"");
}

/// Writes an unsigned integer as exact decimal.
pub(crate) fn write_u64(out: &mut impl Sink, n: u64) {
    out.put(decimal(n, &mut [0; 20]));
}

/// The decimal digits of `n`, written into `buf`.
fn decimal(mut n: u64, buf: &mut [u8; 20]) -> &[u8] {
    let mut i = buf.len();
    loop {
        i -= 1;
        // `n % 10` < 10, so the cast cannot truncate.
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    buf.get(i..).unwrap_or_default()
}

/// An integer's digits (no sign, no leading zeros) in [`write_exact`]'s
/// form: trailing zeros become the power of ten (`1000` is `1e3`).
fn write_exact_integer(out: &mut impl Sink, negative: bool, digits: &[u8]) {
    let end = digits.iter().rposition(|d| *d != b'0').map_or(0, |i| i + 1);
    if end == 0 {
        out.put(b"0");
        return;
    }
    if negative {
        out.put(b"-");
    }
    out.put(&digits[..end]);
    if end < digits.len() {
        out.put(b"e");
        out.put(decimal((digits.len() - end) as u64, &mut [0; 20]));
    }
}

/// Writes a signed integer as exact decimal (serde_json never yields `-0` as an integer).
pub(crate) fn write_i64(out: &mut impl Sink, n: i64) {
    if n < 0 {
        out.put(b"-");
    }
    write_u64(out, n.unsigned_abs());
}

/// Writes a double as ECMAScript `Number.prototype.toString` does (`-0` -> `0`,
/// `1e+30`, `0.002`, ...). JSON parsing never yields NaN or infinities.
pub(crate) fn write_f64(out: &mut impl Sink, f: f64) {
    let mut buf = ryu_js::Buffer::new();
    out.put(buf.format(f).as_bytes());
}

/// How numbers are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Numbers {
    /// Version 3 and before: JCS, a number with a fraction or an exponent as
    /// the double nearest to it (`0.1` and `0.10000000000000000001` alike).
    Doubles,
    /// Version 4: every number as its exact decimal value ([`write_exact`]).
    Exact,
}

/// A double as [`Numbers`] says: its ECMAScript text, or the exact value of
/// that text (the shortest that reads back as the double: what a client
/// holding the double sends).
fn write_double(out: &mut impl Sink, f: f64, numbers: Numbers) {
    match numbers {
        Numbers::Doubles => write_f64(out, f),
        Numbers::Exact => write_exact(out, ryu_js::Buffer::new().format(f)),
    }
}

/// Writes a JSON number literal (`-12.50e3`) as its exact decimal value, one
/// text per value: the significant digits (no leading or trailing zeros),
/// then `e` and the power of ten when it is not 0, a `-` before a negative
/// value. `1`, `1.0`, `1e0` and `10e-1` are all `1`; `1000` and `1e3` are
/// `1e3`; `1.5` is `15e-1`; `-0.0` is `0`. Never longer than the literal
/// and a few bytes: `1e308` is not written out as 309 digits. A literal whose
/// power of ten does not fit 64 bits (`1e-99999999999999999999`, which a
/// parser reads as 0) is written as it is, after a `~` no other text has:
/// one text per literal, never equal to another value's.
pub(crate) fn write_exact(out: &mut impl Sink, literal: &str) {
    if !write_exact_in_range(out, literal) {
        out.put(b"~");
        out.put(literal.as_bytes());
    }
}

/// [`write_exact`] for a literal whose power of ten fits 64 bits; `false`
/// (nothing written) for one whose power does not.
fn write_exact_in_range(out: &mut impl Sink, literal: &str) -> bool {
    let (negative, rest) = match literal.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, literal),
    };
    let (mantissa, exponent) = match rest.find(['e', 'E']) {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, ""),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let (int, frac) = (int.as_bytes(), frac.as_bytes());
    // The significant digits run from the first to the last digit that is
    // not 0, across the point: `int[first..]` then `frac[..=last]`.
    let digit = |i: usize| if i < int.len() { int[i] } else { frac[i - int.len()] };
    let total = int.len() + frac.len();
    let Some(first) = (0..total).find(|&i| digit(i) != b'0') else {
        // Zero, whatever its sign and power.
        out.put(b"0");
        return true;
    };
    let last = (first..total).rfind(|&i| digit(i) != b'0').unwrap_or(first);
    let (sign, magnitude) = match exponent.as_bytes().first() {
        Some(b'-') => (-1i64, &exponent[1..]),
        Some(b'+') => (1, &exponent[1..]),
        _ => (1, exponent),
    };
    let magnitude = magnitude.bytes().try_fold(0i64, |n, d| n.checked_mul(10)?.checked_add(i64::from(d.wrapping_sub(b'0'))));
    let power = magnitude
        .map(|m| sign * m)
        .and_then(|p| p.checked_sub(i64::try_from(frac.len()).ok()?))
        .and_then(|p| p.checked_add(i64::try_from(total - 1 - last).ok()?));
    let Some(power) = power else { return false };
    if negative {
        out.put(b"-");
    }
    if first < int.len() {
        out.put(&int[first..int.len().min(last + 1)]);
    }
    if last >= int.len() {
        out.put(&frac[first.max(int.len()) - int.len()..=last - int.len()]);
    }
    if power != 0 {
        out.put(b"e");
        if power < 0 {
            out.put(b"-");
        }
        out.put(decimal(power.unsigned_abs(), &mut [0; 20]));
    }
    true
}

fn enter(depth: usize) -> Result<usize, FingerprintError> {
    let inner = depth + 1;
    if inner > MAX_DEPTH {
        return Err(FingerprintError::TooDeep { limit: MAX_DEPTH });
    }
    Ok(inner)
}

/// Writes `node` canonically. `depth` is the number of containers around it (0 at the
/// root). Object members are sorted in place here (the parser keeps insertion order);
/// `Excluded` tombstones are skipped. Depth is re-checked because defaults may graft
/// values into the tree after parsing.
pub(crate) fn write_node(out: &mut impl Sink, node: &mut Node<'_>, depth: usize, numbers: Numbers) -> Result<(), FingerprintError> {
    match node {
        Node::Null => out.put(b"null"),
        Node::Bool(true) => out.put(b"true"),
        Node::Bool(false) => out.put(b"false"),
        Node::U64(n) if numbers == Numbers::Exact => write_exact_integer(out, false, decimal(*n, &mut [0; 20])),
        Node::I64(n) if numbers == Numbers::Exact => write_exact_integer(out, *n < 0, decimal(n.unsigned_abs(), &mut [0; 20])),
        Node::BigInt(digits) if numbers == Numbers::Exact => {
            let (negative, digits) = digits.strip_prefix('-').map_or((false, &**digits), |d| (true, d));
            write_exact_integer(out, negative, digits.as_bytes());
        }
        Node::U64(n) => write_u64(out, *n),
        Node::I64(n) => write_i64(out, *n),
        Node::BigInt(digits) => out.put(digits.as_bytes()),
        Node::F64(f) => write_double(out, *f, numbers),
        Node::Decimal(_, literal) if numbers == Numbers::Exact => write_exact(out, literal),
        Node::Decimal(f, _) => write_f64(out, *f),
        Node::Str(s) => write_str(out, s),
        Node::Array(items) => {
            let inner = enter(depth)?;
            out.put(b"[");
            let mut first = true;
            for item in items.iter_mut() {
                if matches!(item, Node::Excluded) {
                    continue;
                }
                if !first {
                    out.put(b",");
                }
                first = false;
                write_node(out, item, inner, numbers)?;
            }
            out.put(b"]");
        }
        Node::Object(members) => {
            let inner = enter(depth)?;
            members.sort_unstable_by(|a, b| cmp_utf16(&a.0, &b.0));
            out.put(b"{");
            let mut first = true;
            for (name, value) in members.iter_mut() {
                if matches!(value, Node::Excluded) {
                    continue;
                }
                if !first {
                    out.put(b",");
                }
                first = false;
                write_str(out, name);
                out.put(b":");
                write_node(out, value, inner, numbers)?;
            }
            out.put(b"}");
        }
        Node::Borrowed(value) => write_value(out, value, depth, numbers)?,
        // Only reachable as a member or element, where the containers skip it.
        Node::Excluded => {}
    }
    Ok(())
}

/// Writes a `serde_json::Value` (a configured default) canonically.
pub(crate) fn write_value(out: &mut impl Sink, value: &Value, depth: usize, numbers: Numbers) -> Result<(), FingerprintError> {
    match value {
        Value::Null => out.put(b"null"),
        Value::Bool(true) => out.put(b"true"),
        Value::Bool(false) => out.put(b"false"),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                write_node(out, &mut Node::U64(u), depth, numbers)?;
            } else if let Some(i) = n.as_i64() {
                write_node(out, &mut Node::I64(i), depth, numbers)?;
            } else if let Some(f) = n.as_f64() {
                write_double(out, f, numbers);
            }
        }
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            let inner = enter(depth)?;
            out.put(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_value(out, item, inner, numbers)?;
            }
            out.put(b"]");
        }
        Value::Object(map) => {
            let inner = enter(depth)?;
            // serde_json's map order (UTF-8 bytes, or insertion with `preserve_order`)
            // is not JCS order, so sort a view of it.
            let mut members: Vec<(&String, &Value)> = map.iter().collect();
            members.sort_unstable_by(|a, b| cmp_utf16(a.0, b.0));
            out.put(b"{");
            for (i, (name, item)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_str(out, name);
                out.put(b":");
                write_value(out, item, inner, numbers)?;
            }
            out.put(b"}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn str_bytes(s: &str) -> String {
        let mut out = Vec::new();
        write_str(&mut out, s);
        String::from_utf8_lossy(&out).into_owned()
    }

    fn f64_text(f: f64) -> String {
        let mut out = Vec::new();
        write_f64(&mut out, f);
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn string_escapes_are_exactly_the_jcs_set() {
        assert_eq!(str_bytes("plain"), r#""plain""#);
        assert_eq!(str_bytes("a\"b\\c"), r#""a\"b\\c""#);
        assert_eq!(str_bytes("\u{8}\u{c}\n\r\t"), r#""\b\f\n\r\t""#);
        assert_eq!(str_bytes("\u{0}\u{1}\u{f}\u{1f}"), r#""\u0000\u0001\u000f\u001f""#);
        // Not escaped: '/', DEL, U+2028, non-ASCII, astral.
        assert_eq!(str_bytes("/\u{7f}\u{2028}é€😀"), "\"/\u{7f}\u{2028}é€😀\"");
    }

    #[test]
    fn integers_are_exact_decimal() {
        let mut out = Vec::new();
        write_u64(&mut out, 0);
        out.push(b' ');
        write_u64(&mut out, u64::MAX);
        out.push(b' ');
        write_i64(&mut out, i64::MIN);
        out.push(b' ');
        write_i64(&mut out, -7);
        assert_eq!(String::from_utf8_lossy(&out), "0 18446744073709551615 -9223372036854775808 -7");
    }

    /// ECMAScript `Number.prototype.toString` for edge doubles, many from RFC 8785
    /// appendix B: shortest round-trip digits, plain notation for 1e-7 < |x| < 1e21.
    #[test]
    fn doubles_follow_ecmascript_number_to_string() {
        let cases: &[(u64, &str)] = &[
            (0x0000000000000000, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x444b1ae4d6e2ef51, "1.0000000000000001e+21"),
            (0x3eb0c6f7a0b5ed8b, "9.999999999999995e-7"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
        ];
        for &(bits, want) in cases {
            assert_eq!(f64_text(f64::from_bits(bits)), want, "bits {bits:#018x}");
        }
    }

    #[test]
    fn utf16_order_differs_from_utf8_order_only_where_it_should() {
        // U+E000 (BMP, private use) vs U+10000 (surrogate pair D800 DC00):
        // UTF-8/code point order says E000 < 10000, UTF-16 order says the opposite.
        assert_eq!(cmp_utf16("\u{e000}", "\u{10000}"), Ordering::Greater);
        assert_eq!(cmp_utf16("\u{ffff}", "\u{10000}"), Ordering::Greater);
        assert_eq!(cmp_utf16("\u{d7ff}", "\u{10000}"), Ordering::Less);
        assert_eq!(cmp_utf16("a", "b"), Ordering::Less);
        assert_eq!(cmp_utf16("ab", "a"), Ordering::Greater);
        assert_eq!(cmp_utf16("", ""), Ordering::Equal);
        assert_eq!(cmp_utf16("x\u{1f600}", "x\u{1f601}"), Ordering::Less);
        assert_eq!(cmp_utf16("\u{80}", "\u{7f}"), Ordering::Greater);
    }

    #[test]
    fn hash_sink_equals_direct_hash_across_buffer_boundaries() {
        // Pieces of many sizes, including ones larger than the staging buffer.
        let pieces: Vec<Vec<u8>> = (0..40usize).map(|i| (0..(i * 37) % 1500).map(|j| (i * 31 + j) as u8).collect()).collect();
        let mut sink = HashSink::new();
        let mut all = Vec::new();
        for p in &pieces {
            sink.put(p);
            all.extend_from_slice(p);
        }
        let direct: [u8; 32] = Sha256::digest(&all).into();
        assert_eq!(sink.finish(), direct);
    }

    #[test]
    fn value_objects_are_sorted_and_depth_checked() {
        let v = serde_json::json!({"b": [1, 2.5, -3], "a": {"\u{e000}": null, "\u{10000}": true}});
        let mut out = Vec::new();
        let r = write_value(&mut out, &v, 0, Numbers::Doubles);
        assert!(r.is_ok());
        assert_eq!(String::from_utf8_lossy(&out), "{\"a\":{\"\u{10000}\":true,\"\u{e000}\":null},\"b\":[1,2.5,-3]}");
        let mut out = Vec::new();
        let r = write_value(&mut out, &serde_json::json!([[1]]), MAX_DEPTH - 1, Numbers::Doubles);
        assert!(matches!(r, Err(FingerprintError::TooDeep { limit: MAX_DEPTH })));
    }
}
