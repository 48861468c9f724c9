//! The small JSON tree the fingerprint is computed from, its parser, and the
//! `exclude` / `defaults` edits.
//!
//! Parsing goes through serde_json (its 128-level recursion limit stays on) with our own
//! `DeserializeSeed`, which
//! - keeps object members in insertion order (sorting happens when serializing),
//! - borrows strings from the body whenever they contain no escapes,
//! - rejects duplicate member names (compared after unescaping), naming the JSON Pointer
//!   of the duplicate,
//! - rejects nesting deeper than [`MAX_DEPTH`] containers *before* serde_json's own limit
//!   is reached, so hostile input never recurses deeper than 64 levels,
//! - re-reads every float literal with `str::parse::<f64>` (see [`NumberCursor`]),
//! - keeps integer literals too large for `u64`/`i64` as their exact digits
//!   ([`Node::BigInt`]) instead of the double serde_json rounds them to.
//!
//! Depth is counted in containers: a top-level scalar has depth 0, `[]` has depth 1, and
//! `[[...]]` with 64 nested arrays (or objects, or a mix) is the deepest accepted document.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

use super::pointer::{JsonPointer, array_index, push_escaped_token};
use super::{FingerprintError, MAX_DEPTH};

/// One JSON value. `'a` covers both the request body (borrowed strings) and the spec
/// (borrowed default values and member names).
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node<'a> {
    Null,
    Bool(bool),
    /// A non-negative integer literal that fits in `u64`.
    U64(u64),
    /// A negative integer literal that fits in `i64`.
    I64(i64),
    /// An integer literal outside `u64`/`i64` (no fraction, no exponent), as its exact
    /// decimal digits with an optional `-`. Never zero (that is `U64(0)`), never with
    /// leading zeros (JSON has none).
    BigInt(Cow<'a, str>),
    /// A number with a fraction or an exponent that did not come from a
    /// body's literal: the double.
    F64(f64),
    /// A number literal of a body with a fraction or an exponent: the double
    /// nearest to it (version 3 and before compare that) and the literal as
    /// written (version 4 compares its exact value).
    Decimal(f64, Cow<'a, str>),
    Str(Cow<'a, str>),
    Array(Vec<Node<'a>>),
    /// Members in document order; names are unique (the parser guarantees it).
    Object(Vec<(Cow<'a, str>, Node<'a>)>),
    /// A configured default, borrowed from the spec instead of cloned per request.
    Borrowed(&'a Value),
    /// Tombstone left by an exclusion; containers skip it when serializing, and array
    /// indices of later exclusions keep referring to the document before any removal.
    Excluded,
}

/// Parses a complete JSON document (UTF-8, no trailing data) into a [`Node`].
pub(crate) fn parse(body: &[u8]) -> Result<Node<'_>, FingerprintError> {
    let text = std::str::from_utf8(body).map_err(|e| FingerprintError::InvalidUtf8 { valid_up_to: e.valid_up_to() })?;
    let mut state = ParseState { failure: None, numbers: NumberCursor::new(text) };
    let mut de = serde_json::Deserializer::from_str(text);
    let seed = NodeSeed { state: &mut state, depth: 1 };
    let result = seed.deserialize(&mut de).and_then(|node| de.end().map(|()| node));
    result.map_err(|e| match state.failure {
        Some(f) => f.into_error(),
        None => invalid_json(&e),
    })
}

fn invalid_json(e: &serde_json::Error) -> FingerprintError {
    let (line, column) = (e.line(), e.column());
    let text = e.to_string();
    let suffix = format!(" at line {line} column {column}");
    let reason = text.strip_suffix(&suffix).unwrap_or(&text).to_owned();
    FingerprintError::InvalidJson { line, column, reason }
}

/// A structural rejection raised inside the visitor. serde only lets us return an opaque
/// `serde_json::Error`, so the real reason travels here, and each enclosing container
/// records its own reference token while the error unwinds.
struct Failure {
    kind: FailureKind,
    /// Reference tokens from the failing container outwards (reversed pointer).
    path_rev: Vec<String>,
}

enum FailureKind {
    TooDeep,
    Duplicate,
}

impl Failure {
    fn into_error(self) -> FingerprintError {
        match self.kind {
            FailureKind::TooDeep => FingerprintError::TooDeep { limit: MAX_DEPTH },
            FailureKind::Duplicate => {
                let mut pointer = String::new();
                for token in self.path_rev.iter().rev() {
                    push_escaped_token(&mut pointer, token);
                }
                FingerprintError::DuplicateMember { pointer }
            }
        }
    }
}

/// Shared by every seed of one parse.
struct ParseState<'t> {
    failure: Option<Failure>,
    numbers: NumberCursor<'t>,
}

/// Recovers the correctly rounded value of float literals.
///
/// serde_json without its `float_roundtrip` feature parses some long decimals one ulp
/// off (the RFC 8785 example `333333333.33333329` among them), which would break JCS
/// equivalence of number spellings. Serde hands the visitor only the `f64`, so this
/// cursor walks the same text in step: numbers are visited in document order, so the
/// n-th number token is the n-th number visited. Integers only bump a counter; the walk
/// happens lazily when a float arrives, so float-free bodies pay nothing.
struct NumberCursor<'t> {
    text: &'t str,
    /// Byte offset just past the last number token read (never inside a string).
    pos: usize,
    /// Integers visited since `pos` whose tokens are still to be skipped.
    pending: usize,
}

impl<'t> NumberCursor<'t> {
    fn new(text: &'t str) -> Self {
        NumberCursor { text, pos: 0, pending: 0 }
    }

    fn skip_integer(&mut self) {
        self.pending += 1;
    }

    /// The literal of the number serde_json delivered as the double `parsed` (a float,
    /// or an integer too large for `u64`/`i64`), with its correctly rounded value.
    /// `None` if the literal cannot be found or disagrees by more than rounding (which
    /// would mean the cursor lost step; it cannot for valid input).
    fn float_literal(&mut self, parsed: f64) -> Option<(&'t str, f64)> {
        let mut token = None;
        for _ in 0..=self.pending {
            token = self.next_number_token();
        }
        self.pending = 0;
        let token = token?;
        let exact = token.parse::<f64>().ok()?;
        let in_step =
            exact.is_finite() && exact.is_sign_negative() == parsed.is_sign_negative() && exact.to_bits().abs_diff(parsed.to_bits()) <= 16;
        in_step.then_some((token, exact))
    }

    /// The next number token at or after `pos`, skipping strings (and their escapes),
    /// punctuation and the literals `true`, `false`, `null`.
    fn next_number_token(&mut self) -> Option<&'t str> {
        let bytes = self.text.as_bytes();
        let mut i = self.pos;
        loop {
            i += bytes.get(i..)?.iter().position(|&b| b == b'"' || b == b'-' || b.is_ascii_digit())?;
            if bytes.get(i) == Some(&b'"') {
                i += 1;
                loop {
                    i += bytes.get(i..)?.iter().position(|&b| b == b'"' || b == b'\\')?;
                    let quote = bytes.get(i) == Some(&b'"');
                    i += if quote { 1 } else { 2 };
                    if quote {
                        break;
                    }
                }
            } else {
                let start = i;
                let token = bytes.get(i..)?;
                i += token.iter().position(|b| !matches!(b, b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')).unwrap_or(token.len());
                self.pos = i;
                return self.text.get(start..i);
            }
        }
    }
}

struct NodeSeed<'s, 't> {
    state: &'s mut ParseState<'t>,
    /// Depth this value would have if it is a container (root container = 1).
    depth: usize,
}

impl<'de> DeserializeSeed<'de> for NodeSeed<'_, 'de> {
    type Value = Node<'de>;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Node<'de>, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl NodeSeed<'_, '_> {
    fn fail<E: de::Error>(self, kind: FailureKind, path_rev: Vec<String>, msg: &str) -> E {
        self.state.failure = Some(Failure { kind, path_rev });
        E::custom(msg)
    }

    fn check_depth<E: de::Error>(self) -> Result<Self, E> {
        if self.depth > MAX_DEPTH { Err(self.fail(FailureKind::TooDeep, Vec::new(), "nesting too deep")) } else { Ok(self) }
    }
}

/// Records `token` on the failure path if the error being propagated is ours.
fn note_path(failure: &mut Option<Failure>, token: impl FnOnce() -> String) {
    if let Some(f) = failure {
        f.path_rev.push(token());
    }
}

impl<'de> Visitor<'de> for NodeSeed<'_, 'de> {
    type Value = Node<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Node<'de>, E> {
        Ok(Node::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Node<'de>, E> {
        Ok(Node::Bool(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Node<'de>, E> {
        self.state.numbers.skip_integer();
        Ok(Node::U64(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Node<'de>, E> {
        self.state.numbers.skip_integer();
        Ok(Node::I64(v))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Node<'de>, E> {
        Ok(match self.state.numbers.float_literal(v) {
            Some((literal, exact)) => number_node(literal, exact),
            None => Node::F64(v),
        })
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Node<'de>, E> {
        Ok(Node::Str(Cow::Borrowed(v)))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Node<'de>, E> {
        Ok(Node::Str(Cow::Owned(v.to_owned())))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Node<'de>, E> {
        Ok(Node::Str(Cow::Owned(v)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Node<'de>, A::Error> {
        let this = self.check_depth()?;
        let mut items = Vec::new();
        loop {
            let child = NodeSeed { state: &mut *this.state, depth: this.depth + 1 };
            match seq.next_element_seed(child) {
                Ok(Some(item)) => items.push(item),
                Ok(None) => break,
                Err(e) => {
                    note_path(&mut this.state.failure, || items.len().to_string());
                    return Err(e);
                }
            }
        }
        Ok(Node::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Node<'de>, A::Error> {
        let this = self.check_depth()?;
        let mut members: Vec<(Cow<'de, str>, Node<'de>)> = Vec::new();
        while let Some(name) = map.next_key_seed(NameSeed)? {
            let child = NodeSeed { state: &mut *this.state, depth: this.depth + 1 };
            match map.next_value_seed(child) {
                Ok(value) => members.push((name, value)),
                Err(e) => {
                    note_path(&mut this.state.failure, || name.into_owned());
                    return Err(e);
                }
            }
        }
        if let Some(dup) = find_duplicate(&members) {
            let path = vec![dup.to_owned()];
            return Err(this.fail(FailureKind::Duplicate, path, "duplicate member name"));
        }
        Ok(Node::Object(members))
    }
}

/// The node for a number literal that serde_json delivered as a double: an integer
/// literal (digits and an optional `-`, no fraction, no exponent) keeps its exact digits,
/// so integers of any size compare exactly; anything else is the double `exact`.
fn number_node(literal: &str, exact: f64) -> Node<'_> {
    let digits = literal.strip_prefix('-').unwrap_or(literal);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Node::Decimal(exact, Cow::Borrowed(literal));
    }
    // JSON allows no leading zeros, so the only zero integer literals are `0` and `-0`
    // (serde_json delivers `-0` as a double); both are 0.
    if digits.bytes().all(|b| b == b'0') {
        return Node::U64(0);
    }
    Node::BigInt(Cow::Borrowed(literal))
}

/// Objects up to this size are checked pairwise; larger ones through a sorted view, so a
/// hostile object with many members costs O(n log n), not O(n^2).
const PAIRWISE_LIMIT: usize = 16;

fn find_duplicate<'m>(members: &'m [(Cow<'_, str>, Node<'_>)]) -> Option<&'m str> {
    if members.len() <= PAIRWISE_LIMIT {
        for (i, (name, _)) in members.iter().enumerate() {
            if members.iter().take(i).any(|(earlier, _)| earlier == name) {
                return Some(name);
            }
        }
        return None;
    }
    let mut names: Vec<&str> = members.iter().map(|(name, _)| name.as_ref()).collect();
    names.sort_unstable();
    names.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

/// Member names: borrowed from the body when they contain no escapes.
struct NameSeed;

impl<'de> DeserializeSeed<'de> for NameSeed {
    type Value = Cow<'de, str>;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for NameSeed {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v))
    }
}

/// Turns a borrowed default that is a container into an owned container of borrowed
/// children (one level only), so an edit can reach inside it.
fn materialize<'a>(node: &mut Node<'a>) {
    if let Node::Borrowed(value) = *node {
        match value {
            Value::Object(map) => {
                *node = Node::Object(map.iter().map(|(k, v)| (Cow::Borrowed(k.as_str()), Node::Borrowed(v))).collect());
            }
            Value::Array(items) => *node = Node::Array(items.iter().map(Node::Borrowed).collect()),
            _ => {}
        }
    }
}

/// One step down: a member of an object or an element of an array.
fn child<'n, 'a>(node: &'n mut Node<'a>, token: &str) -> Option<&'n mut Node<'a>> {
    materialize(node);
    match node {
        Node::Object(members) => members.iter_mut().find(|(name, _)| name == token).map(|(_, v)| v),
        Node::Array(items) => array_index(token).and_then(|i| items.get_mut(i)),
        _ => None,
    }
}

/// The node at `tokens`, if every step exists. Tombstones are not descended into.
pub(crate) fn navigate<'n, 'a>(root: &'n mut Node<'a>, tokens: &[String]) -> Option<&'n mut Node<'a>> {
    let mut current = root;
    for token in tokens {
        current = child(current, token)?;
    }
    Some(current)
}

/// Inserts `value` at `pointer` if nothing is there yet. Only inserts into an existing
/// object: a missing parent, or a parent that is an array or scalar, makes this a no-op
/// (defaults never create intermediate objects or grow arrays).
pub(crate) fn apply_default<'a>(root: &mut Node<'a>, pointer: &'a JsonPointer, value: &'a Value) {
    let Some((last, parents)) = pointer.tokens().split_last() else {
        return;
    };
    let Some(parent) = navigate(root, parents) else {
        return;
    };
    materialize(parent);
    if let Node::Object(members) = parent
        && !members.iter().any(|(name, _)| name == last)
    {
        members.push((Cow::Borrowed(last.as_str()), Node::Borrowed(value)));
    }
}

/// Marks the member or array element at `pointer` as excluded; a no-op if it does not
/// exist. Array indices refer to the document as it was before any exclusion.
pub(crate) fn apply_exclusion(root: &mut Node<'_>, pointer: &JsonPointer) {
    let Some((last, parents)) = pointer.tokens().split_last() else {
        return;
    };
    if let Some(target) = navigate(root, parents).and_then(|parent| child(parent, last)) {
        *target = Node::Excluded;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(body: &str) -> Node<'_> {
        match parse(body.as_bytes()) {
            Ok(n) => n,
            Err(e) => panic!("{body:?} should parse: {e}"),
        }
    }

    fn err(body: &[u8]) -> FingerprintError {
        match parse(body) {
            Ok(n) => panic!("{body:?} should fail, got {n:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn keeps_insertion_order_and_borrows_plain_strings() {
        let node = ok(r#"{"b": "x", "a": "y\n"}"#);
        let Node::Object(members) = node else { panic!("not an object: {node:?}") };
        let names: Vec<&str> = members.iter().map(|(n, _)| n.as_ref()).collect();
        assert_eq!(names, ["b", "a"]);
        assert!(matches!(members[0].0, Cow::Borrowed("b")));
        assert!(matches!(members[0].1, Node::Str(Cow::Borrowed("x"))));
        // Escapes force an owned, unescaped copy.
        assert_eq!(members[1].1, Node::Str(Cow::Owned("y\n".to_owned())));
    }

    #[test]
    fn numbers_keep_their_serde_json_kind() {
        let node = ok("[1, -1, 1.0, -0, 18446744073709551615, 18446744073709551616, -9223372036854775809, 1e19, -0.0]");
        assert_eq!(
            node,
            Node::Array(vec![
                Node::U64(1),
                Node::I64(-1),
                Node::Decimal(1.0, Cow::Borrowed("1.0")),
                Node::U64(0),
                Node::U64(u64::MAX),
                Node::BigInt(Cow::Borrowed("18446744073709551616")),
                Node::BigInt(Cow::Borrowed("-9223372036854775809")),
                Node::Decimal(1e19, Cow::Borrowed("1e19")),
                Node::Decimal(-0.0, Cow::Borrowed("-0.0")),
            ])
        );
    }

    fn floats(body: &str) -> Vec<u64> {
        match ok(body) {
            Node::Array(items) => items
                .iter()
                .filter_map(|n| match n {
                    Node::F64(f) | Node::Decimal(f, _) => Some(f.to_bits()),
                    _ => None,
                })
                .collect(),
            other => panic!("not an array: {other:?}"),
        }
    }

    #[test]
    fn floats_are_correctly_rounded() {
        // serde_json's default parser reads this one ulp low (333333333.33333325);
        // the nearest double prints as 333333333.3333333.
        assert_eq!(floats("[333333333.33333329]"), [333333333.3333333f64.to_bits()]);
        // Tokens inside strings (with escaped quotes) and integers keep the cursor in step.
        let body = r#"[1, "2.5", {"k\"3.5": "\\", "x": -4}, 0.30000000000000004, 7, 2.2250738585072014e-308, 5e-324, "9e9", 1.7976931348623157e308]"#;
        let got = floats(body);
        let want: Vec<u64> =
            [0.30000000000000004f64, 2.2250738585072014e-308, 5e-324, 1.7976931348623157e308].iter().map(|f| f.to_bits()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn float_literals_agree_with_std_parse() {
        // Long mantissas and exponents, the inputs fast float paths get wrong.
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut literals = Vec::new();
        for i in 0..2000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let digits = 15 + (seed % 8) as usize;
            let mantissa: String = format!("{seed:020}").chars().take(digits).collect();
            let exp = (seed >> 40) as i64 % 40 - 20;
            let sign = if i % 3 == 0 { "-" } else { "" };
            literals.push(format!("{sign}{}.{}e{exp}", &mantissa[..1], &mantissa[1..]));
        }
        let body = format!("[{}]", literals.join(","));
        let want: Vec<u64> = literals.iter().map(|l| l.parse::<f64>().map(f64::to_bits).unwrap_or_default()).collect();
        assert_eq!(floats(&body), want);
    }

    #[test]
    fn duplicate_at_top_level_names_pointer() {
        assert_eq!(err(br#"{"a": 1, "b": 2, "a": 3}"#), FingerprintError::DuplicateMember { pointer: "/a".into() });
    }

    #[test]
    fn duplicate_detected_after_unescaping() {
        assert_eq!(err(br#"{"A": 1, "\u0041": 2}"#), FingerprintError::DuplicateMember { pointer: "/A".into() });
    }

    #[test]
    fn duplicate_nested_names_full_escaped_pointer() {
        let body = br#"{"ok": 1, "a/b": [0, {"x": {"m~n": true, "m~n": false}}]}"#;
        assert_eq!(err(body), FingerprintError::DuplicateMember { pointer: "/a~1b/1/x/m~0n".into() });
    }

    #[test]
    fn duplicate_in_large_object_uses_sorted_path() {
        let mut body = String::from("{");
        for i in 0..100 {
            body.push_str(&format!("\"k{i}\": {i},"));
        }
        body.push_str("\"k42\": 0}");
        assert_eq!(err(body.as_bytes()), FingerprintError::DuplicateMember { pointer: "/k42".into() });
        // And the same object without the duplicate is fine.
        let clean = body.replace("\"k42\": 0}", "\"k100\": 0}");
        assert!(parse(clean.as_bytes()).is_ok());
    }

    fn nested(open: &str, close: &str, n: usize) -> String {
        format!("{}{}", open.repeat(n), close.repeat(n))
    }

    #[test]
    fn depth_64_is_accepted_65_rejected() {
        assert!(parse(nested("[", "]", MAX_DEPTH).as_bytes()).is_ok());
        assert_eq!(err(nested("[", "]", MAX_DEPTH + 1).as_bytes()), FingerprintError::TooDeep { limit: 64 });
        let objects = format!("{}1{}", "{\"a\":".repeat(MAX_DEPTH + 1), "}".repeat(MAX_DEPTH + 1));
        assert_eq!(err(objects.as_bytes()), FingerprintError::TooDeep { limit: 64 });
        let objects = format!("{}1{}", "{\"a\":".repeat(MAX_DEPTH), "}".repeat(MAX_DEPTH));
        assert!(parse(objects.as_bytes()).is_ok());
    }

    #[test]
    fn depth_counts_mixed_containers() {
        // 32 objects around 32 arrays = 64: ok; one more array: too deep.
        let ok_doc = format!("{}{}{}{}", "{\"a\":".repeat(32), "[".repeat(32), "]".repeat(32), "}".repeat(32));
        assert!(parse(ok_doc.as_bytes()).is_ok());
        let deep = format!("{}{}{}{}", "{\"a\":".repeat(32), "[".repeat(33), "]".repeat(33), "}".repeat(32));
        assert_eq!(err(deep.as_bytes()), FingerprintError::TooDeep { limit: 64 });
    }

    #[test]
    fn ten_thousand_deep_is_rejected_without_overflow() {
        // Runs on the default (2 MiB) test thread on purpose.
        assert_eq!(err(nested("[", "]", 10_000).as_bytes()), FingerprintError::TooDeep { limit: 64 });
        // Unterminated, too: the depth check fires before the syntax error.
        assert_eq!(err("[".repeat(10_000).as_bytes()), FingerprintError::TooDeep { limit: 64 });
        let objects = "{\"a\":".repeat(10_000);
        assert_eq!(err(objects.as_bytes()), FingerprintError::TooDeep { limit: 64 });
    }

    #[test]
    fn invalid_json_reports_position() {
        let FingerprintError::InvalidJson { line, column, reason } = err(b"{\n  \"a\": tru }") else {
            panic!("expected InvalidJson");
        };
        assert_eq!((line, column), (2, 11));
        assert!(!reason.contains("line"), "{reason}");
        assert!(matches!(err(b"{\"a\":1} x"), FingerprintError::InvalidJson { .. }));
        assert!(matches!(err(b"[1,]"), FingerprintError::InvalidJson { .. }));
        assert!(matches!(err(b"{\"a\" 1}"), FingerprintError::InvalidJson { .. }));
        assert!(matches!(err(b"   "), FingerprintError::InvalidJson { .. }));
        assert!(matches!(err(b"1e400"), FingerprintError::InvalidJson { .. }));
        assert!(matches!(err(b"NaN"), FingerprintError::InvalidJson { .. }));
        assert!(matches!(err(b"\"\\x\""), FingerprintError::InvalidJson { .. }));
        assert!(matches!(err(b"\"a\tb\""), FingerprintError::InvalidJson { .. }));
    }

    #[test]
    fn lone_surrogates_are_rejected() {
        for body in [r#"["\ud800"]"#, r#""\udc00""#, r#""\ud800x""#, r#""\ud800\u0041""#, r#""\udbff\udbff""#] {
            let e = err(body.as_bytes());
            assert!(matches!(e, FingerprintError::InvalidJson { .. }), "{body}: {e:?}");
        }
        // A proper pair is fine.
        assert_eq!(ok(r#""\ud83d\ude00""#), Node::Str(Cow::Owned("\u{1f600}".to_owned())));
    }

    #[test]
    fn invalid_utf8_is_rejected_with_offset() {
        assert_eq!(err(b"[\"ab\xff\"]"), FingerprintError::InvalidUtf8 { valid_up_to: 4 });
        // A UTF-8 byte order mark is valid UTF-8 but not JSON.
        assert!(matches!(err(b"\xef\xbb\xbf{}"), FingerprintError::InvalidJson { .. }));
        // Overlong encoding of '/'.
        assert_eq!(err(b"\"\xc0\xaf\""), FingerprintError::InvalidUtf8 { valid_up_to: 1 });
    }

    fn ptr(s: &str) -> JsonPointer {
        match JsonPointer::parse(s) {
            Ok(p) => p,
            Err(e) => panic!("{s}: {e}"),
        }
    }

    fn render(node: &mut Node<'_>) -> String {
        let mut out = Vec::new();
        assert!(super::super::canonical::write_node(&mut out, node, 0, super::super::canonical::Numbers::Doubles).is_ok());
        String::from_utf8_lossy(&out).into_owned()
    }

    #[test]
    fn exclusions_use_original_indices_and_ignore_missing() {
        let mut node = ok(r#"{"a": [10, 11, 12, 13], "b": {"c": 1, "d": 2}, "e": 3}"#);
        for p in ["/a/1", "/a/2", "/b/c", "/missing", "/b/c/deeper", "/e/x", "/a/9", "/a/-", "/a/01"] {
            apply_exclusion(&mut node, &ptr(p));
        }
        assert_eq!(render(&mut node), r#"{"a":[10,13],"b":{"d":2},"e":3}"#);
    }

    #[test]
    fn defaults_insert_only_into_existing_objects() {
        let p_cur = ptr("/currency");
        let p_nested = ptr("/shipping/method");
        let p_missing_parent = ptr("/nope/x");
        let p_array_parent = ptr("/items/0");
        let usd = Value::from("USD");
        let std_ = Value::from("standard");
        let mut node = ok(r#"{"shipping": {}, "items": [1]}"#);
        apply_default(&mut node, &p_cur, &usd);
        apply_default(&mut node, &p_nested, &std_);
        apply_default(&mut node, &p_missing_parent, &usd);
        apply_default(&mut node, &p_array_parent, &usd);
        assert_eq!(render(&mut node), r#"{"currency":"USD","items":[1],"shipping":{"method":"standard"}}"#);
        // Present values are kept.
        let mut node = ok(r#"{"currency": "EUR"}"#);
        apply_default(&mut node, &p_cur, &usd);
        assert_eq!(render(&mut node), r#"{"currency":"EUR"}"#);
        // A non-object root is left alone.
        let mut node = ok("[1]");
        apply_default(&mut node, &p_cur, &usd);
        assert_eq!(render(&mut node), "[1]");
    }

    #[test]
    fn edits_reach_inside_borrowed_defaults() {
        let p_meta = ptr("/meta");
        let p_meta_b = ptr("/meta/b");
        let p_meta_c = ptr("/meta/c");
        let meta = serde_json::json!({"a": 1, "b": [1, 2]});
        let two = Value::from(2);
        let mut node = ok("{}");
        apply_default(&mut node, &p_meta, &meta);
        apply_default(&mut node, &p_meta_c, &two);
        apply_exclusion(&mut node, &p_meta_b);
        assert_eq!(render(&mut node), r#"{"meta":{"a":1,"c":2}}"#);
    }
}
