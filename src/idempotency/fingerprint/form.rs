//! `application/x-www-form-urlencoded` pairs, for query strings and form bodies.
//!
//! Parsing follows the WHATWG URL standard's urlencoded parser (split on `&`, skip empty
//! sequences, split each at the first `=`, `+` -> space, percent-decode, a `%` not
//! followed by two hex digits stays literal) but keeps the decoded *bytes* instead of
//! replacing invalid UTF-8 with U+FFFD: a lossy decode would let `%FE` and `%FF` collide.
//! Pairs are sorted by name bytewise (for UTF-8, code point order) with a stable sort, so
//! the values of one name keep the order they were sent in: `tag=a&tag=b` is another list
//! than `tag=b&tag=a`, as frameworks read them. (Fingerprint version 1 sorted by
//! (name, value), making the two the same request; [`PairOrder::NameThenValue`] keeps
//! that order for recognising records it wrote.)

use std::borrow::Cow;

use super::canonical::Sink;
use super::{put_field, put_len};

/// A decoded (name, value) pair; borrowed when no `+` or `%` needed decoding.
pub(crate) type Pair<'a> = (Cow<'a, [u8]>, Cow<'a, [u8]>);

/// How pairs are put in order before hashing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PairOrder {
    /// By name, one name's values in request order (fingerprint version 2).
    Name,
    /// By (name, value) (fingerprint version 1).
    NameThenValue,
}

/// Parses and sorts the pairs of a urlencoded string. `a`, `a=` and `a=&&` all yield the
/// single pair `("a", "")`; the empty string yields none.
pub(crate) fn sorted_pairs(input: &[u8], order: PairOrder) -> Vec<Pair<'_>> {
    let mut pairs: Vec<Pair<'_>> = input
        .split(|&b| b == b'&')
        .filter(|seq| !seq.is_empty())
        .map(|seq| match seq.iter().position(|&b| b == b'=') {
            Some(eq) => (decode(seq.get(..eq).unwrap_or_default()), decode(seq.get(eq + 1..).unwrap_or_default())),
            None => (decode(seq), Cow::Borrowed(&[][..])),
        })
        .collect();
    match order {
        PairOrder::Name => pairs.sort_by(|a, b| a.0.cmp(&b.0)),
        PairOrder::NameThenValue => pairs.sort_unstable(),
    }
    pairs
}

/// Writes the pair count, then each name and value as length-prefixed fields.
pub(crate) fn write_pairs(out: &mut impl Sink, pairs: &[Pair<'_>]) {
    put_len(out, pairs.len());
    for (name, value) in pairs {
        put_field(out, name);
        put_field(out, value);
    }
}

/// The value of one hex digit of a percent-escape (either case).
pub(crate) fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// `+` -> space and percent-decoding, without allocating when neither occurs.
fn decode(raw: &[u8]) -> Cow<'_, [u8]> {
    if !raw.iter().any(|&b| b == b'+' || b == b'%') {
        return Cow::Borrowed(raw);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while let Some(&b) = raw.get(i) {
        match b {
            b'+' => out.push(b' '),
            b'%' => {
                let hi = raw.get(i + 1).copied().and_then(hex_value);
                let lo = raw.get(i + 2).copied().and_then(hex_value);
                if let (Some(hi), Some(lo)) = (hi, lo) {
                    out.push(hi << 4 | lo);
                    i += 3;
                    continue;
                }
                out.push(b'%');
            }
            other => out.push(other),
        }
        i += 1;
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(s: &str) -> Vec<(String, String)> {
        sorted_pairs(s.as_bytes(), PairOrder::Name)
            .into_iter()
            .map(|(n, v)| (String::from_utf8_lossy(&n).into_owned(), String::from_utf8_lossy(&v).into_owned()))
            .collect()
    }

    fn p(n: &str, v: &str) -> (String, String) {
        (n.to_owned(), v.to_owned())
    }

    #[test]
    fn sorts_by_name_keeping_the_order_of_a_names_values() {
        assert_eq!(pairs("b=2&a=9&a=1&c"), [p("a", "9"), p("a", "1"), p("b", "2"), p("c", "")]);
        assert_eq!(pairs("tag=b&x=1&tag=a&tag=c"), [p("tag", "b"), p("tag", "a"), p("tag", "c"), p("x", "1")]);
        // Version 1's order, kept for its records.
        let v1 = |s: &str| -> Vec<(Vec<u8>, Vec<u8>)> {
            sorted_pairs(s.as_bytes(), PairOrder::NameThenValue).into_iter().map(|(n, v)| (n.into_owned(), v.into_owned())).collect()
        };
        assert_eq!(v1("b=2&a=9&a=1&c"), v1("c&a=1&b=2&a=9"));
    }

    #[test]
    fn decodes_plus_and_percent() {
        assert_eq!(pairs("q=a+b%20c%2Bd&%C3%A9=%e2%82%ac"), [p("q", "a b c+d"), p("é", "€")]);
    }

    #[test]
    fn malformed_percent_sequences_stay_literal() {
        assert_eq!(pairs("a=%&b=%4&c=%zz&d=100%"), [p("a", "%"), p("b", "%4"), p("c", "%zz"), p("d", "100%")]);
    }

    #[test]
    fn empty_sequences_and_missing_values() {
        assert_eq!(pairs(""), Vec::<(String, String)>::new());
        assert_eq!(pairs("&&"), Vec::<(String, String)>::new());
        assert_eq!(pairs("a"), pairs("a="));
        assert_eq!(pairs("a=&&"), [p("a", "")]);
        assert_eq!(pairs("=x"), [p("", "x")]);
        assert_eq!(pairs("a=b=c"), [p("a", "b=c")]);
    }

    #[test]
    fn invalid_utf8_escapes_do_not_collide() {
        let fe = sorted_pairs(b"a=%FE", PairOrder::Name);
        let ff = sorted_pairs(b"a=%FF", PairOrder::Name);
        assert_eq!(fe[0].1.as_ref(), [0xfe]);
        assert_eq!(ff[0].1.as_ref(), [0xff]);
        assert_ne!(fe, ff);
    }

    #[test]
    fn agrees_with_form_urlencoded_crate_on_utf8_input() {
        for input in ["a=1&b=2", "x=%41+%42&y", "%E2%82%AC=euro&&z=%", "k=v=w&k=a", "=&=", "a%2Bb=c%26d"] {
            let mut theirs: Vec<(String, String)> =
                form_urlencoded::parse(input.as_bytes()).map(|(n, v)| (n.into_owned(), v.into_owned())).collect();
            theirs.sort_by(|a, b| a.0.cmp(&b.0));
            assert_eq!(pairs(input), theirs, "{input}");
        }
    }

    #[test]
    fn borrows_when_nothing_to_decode() {
        let v = sorted_pairs(b"plain=value", PairOrder::Name);
        assert!(matches!(v[0].0, Cow::Borrowed(b"plain")));
        assert!(matches!(v[0].1, Cow::Borrowed(b"value")));
    }
}
