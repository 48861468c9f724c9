//! Tests of the public API: canonical JSON, the hash's inputs, and its encoding.

use super::*;
use http::HeaderValue;
use sha2::{Digest, Sha256};

const JSON: &str = "application/json";
const FORM: &str = "application/x-www-form-urlencoded";

/// An owned request to fingerprint.
#[derive(Clone)]
struct Req {
    method: Method,
    operation: String,
    params: Vec<(String, String)>,
    query: Option<String>,
    headers: HeaderMap,
    body: Vec<u8>,
}

impl Req {
    fn new(content_type: Option<&str>, body: &[u8]) -> Req {
        let mut req = Req {
            method: Method::POST,
            operation: "create_order".into(),
            params: Vec::new(),
            query: None,
            headers: HeaderMap::new(),
            body: body.to_vec(),
        };
        if let Some(ct) = content_type {
            req = req.header("content-type", ct);
        }
        req
    }

    fn json(body: &str) -> Req {
        Req::new(Some(JSON), body.as_bytes())
    }

    fn header(mut self, name: &str, value: &str) -> Req {
        let name = HeaderName::from_bytes(name.as_bytes()).expect("test header name");
        let value = HeaderValue::from_str(value).expect("test header value");
        self.headers.append(name, value);
        self
    }

    fn query(mut self, q: Option<&str>) -> Req {
        self.query = q.map(str::to_owned);
        self
    }

    fn params(mut self, params: &[(&str, &str)]) -> Req {
        self.params = params.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect();
        self
    }

    fn parts(&self) -> RequestParts<'_> {
        RequestParts {
            method: &self.method,
            operation: &self.operation,
            path_params: &self.params,
            query: self.query.as_deref(),
            headers: &self.headers,
            body: &self.body,
        }
    }

    fn try_fp(&self, spec: &FingerprintSpec) -> Result<Fingerprint, FingerprintError> {
        fingerprint(spec, &self.parts())
    }

    fn fp(&self, spec: &FingerprintSpec) -> Fingerprint {
        match self.try_fp(spec) {
            Ok(fp) => fp,
            Err(e) => panic!("fingerprint failed: {e}"),
        }
    }
}

fn none() -> FingerprintSpec {
    FingerprintSpec::default()
}

fn ptr(s: &str) -> JsonPointer {
    JsonPointer::parse(s).expect("test pointer")
}

fn spec(exclude: &[&str], defaults: &[(&str, Value)], headers: &[&str]) -> FingerprintSpec {
    FingerprintSpec {
        exclude: exclude.iter().map(|p| ptr(p)).collect(),
        defaults: defaults.iter().map(|(p, v)| (ptr(p), v.clone())).collect(),
        headers: headers.iter().map(|h| HeaderName::from_bytes(h.as_bytes()).expect("test header name")).collect(),
    }
}

fn canon_with(body: &str, spec: &FingerprintSpec) -> String {
    match canonical_json(body.as_bytes(), spec) {
        Ok(bytes) => String::from_utf8(bytes).expect("canonical JSON is UTF-8"),
        Err(e) => panic!("canonical_json({body:?}) failed: {e}"),
    }
}

fn canon(body: &str) -> String {
    canon_with(body, &none())
}

// ---- canonical JSON -------------------------------------------------------------

#[test]
fn member_order_and_whitespace_do_not_matter() {
    let a = r#"{"b": 2, "a": {"y": [1, 2], "x": null}}"#;
    let b = "{ \"a\" :{\"x\":null ,\n\t\"y\":[ 1,2 ]} ,\r\n \"b\":2 }";
    assert_eq!(canon(a), r#"{"a":{"x":null,"y":[1,2]},"b":2}"#);
    assert_eq!(canon(b), canon(a));
    assert_eq!(Req::json(a).fp(&none()), Req::json(b).fp(&none()));
    // Array order does matter.
    assert_ne!(Req::json("[1,2]").fp(&none()), Req::json("[2,1]").fp(&none()));
}

#[test]
fn number_spellings_canonicalize_to_their_exact_value() {
    assert_eq!(canon("[1.0, 1, 1e0, 10e-1, 0.1e1, -0, -0.0, 0, 1E+2, 100, 1e2]"), "[1,1,1,1,1,0,0,0,1e2,1e2,1e2]");
    assert_eq!(canon("[0.1, 0.10, 1e-1]"), "[1e-1,1e-1,1e-1]");
    assert_eq!(canon("[1e21, 1e20, 1.5e-7, -2.5E-3, 123e-20]"), "[1e21,1e20,15e-8,-25e-4,123e-20]");
    let one = Req::json(r#"{"n": 1}"#).fp(&none());
    for spelling in ["1.0", "1e0", "10e-1", "0.01e2"] {
        assert_eq!(Req::json(&format!(r#"{{"n": {spelling}}}"#)).fp(&none()), one, "{spelling}");
    }
    assert_ne!(Req::json(r#"{"n": 1.000001}"#).fp(&none()), one);
    assert_eq!(Req::json(r#"{"n": -0}"#).fp(&none()), Req::json(r#"{"n": 0}"#).fp(&none()));
}

/// Clients draw a new multipart boundary for every request (curl `-F`,
/// Python requests' `files=`, a browser's FormData): the same parts under
/// another boundary are the same request; other parts are not.
#[test]
fn multipart_bodies_are_compared_by_their_parts() {
    let body = |b: &str, value: &str| {
        format!("--{b}\r\nContent-Disposition: form-data; name=\"doc\"; filename=\"a.txt\"\r\n\r\n{value}\r\n--{b}--\r\n")
    };
    let fp = |b: &str, value: &str, quoted: bool| {
        let ct = if quoted { format!("multipart/form-data; boundary=\"{b}\"") } else { format!("multipart/form-data; boundary={b}") };
        Req::new(Some(&ct), body(b, value).as_bytes()).fp(&none())
    };
    assert_eq!(fp("XyZ1", "hello", false), fp("----WebKitFormBoundary7MA4YWxk", "hello", false));
    assert_eq!(fp("XyZ1", "hello", false), fp("q", "hello", true));
    assert_ne!(fp("XyZ1", "hello", false), fp("XyZ2", "hellp", false));
    // `--boundary` inside a line is content, not a delimiter.
    let inline = |b: &str| {
        let body = format!("--{b}\r\nContent-Disposition: form-data; name=\"memo\"\r\n\r\npay--{b}now\r\n--{b}--\r\n");
        Req::new(Some(&format!("multipart/form-data; boundary={b}")), body.as_bytes()).fp(&none())
    };
    assert_ne!(inline("X"), inline("Y"), "pay--Xnow and pay--Ynow are two memos");
    // Without a boundary the bytes are compared as they are.
    let raw = |b: &str| Req::new(Some("multipart/form-data"), body(b, "hello").as_bytes()).fp(&none());
    assert_ne!(raw("XyZ1"), raw("XyZ2"));
}

/// A form's fields take `exclude` and `defaults` as a JSON object's members
/// do (a Rails form's `authenticity_token` differs on every render).
#[test]
fn form_fields_take_exclusions_and_defaults() {
    let spec = spec(&["/authenticity_token", "/a/b"], &[("/currency", serde_json::json!("USD")), ("/qty", serde_json::json!(1))], &[]);
    let form = |body: &str| Req::new(Some(FORM), body.as_bytes()).fp(&spec);
    assert_eq!(form("item=book&authenticity_token=x1"), form("item=book&authenticity_token=y2"));
    assert_eq!(form("item=book&authenticity_token=x1"), form("item=book&currency=USD&qty=1"));
    assert_ne!(form("item=book&currency=EUR"), form("item=book"));
    assert_ne!(form("item=book&qty=2"), form("item=book"));
    // Without the settings the token counts.
    let plain = |body: &str| Req::new(Some(FORM), body.as_bytes()).fp(&none());
    assert_ne!(plain("item=book&authenticity_token=x1"), plain("item=book&authenticity_token=y2"));
}

/// JSON sent under the form type (curl's `-d` without a type): its bytes,
/// not its decoding as a form, which takes `+` for a space and `%61` for
/// `a`; a real form keeps the form's comparison.
#[test]
fn json_sent_as_a_form_is_compared_as_bytes() {
    let form = |body: &str| Req::new(Some(FORM), body.as_bytes()).fp(&none());
    assert_ne!(form(r#"{"memo":"pay 100+tip"}"#), form(r#"{"memo":"pay 100 tip"}"#));
    assert_ne!(form(r#"{"to":"%61lice"}"#), form(r#"{"to":"alice"}"#));
    assert_ne!(form(r#"[1,"a+b"]"#), form(r#"[1,"a b"]"#));
    assert_ne!(form(" \n{\"m\":\"a+b\"}"), form(" \n{\"m\":\"a b\"}"), "after white space too");
    assert_eq!(form(r#"{"memo":"pay"}"#), form(r#"{"memo":"pay"}"#));
    assert_eq!(form("memo=pay+100&to=%61lice"), form("memo=pay%20100&to=alice"));
}

/// Amounts that are one double but not one number are two requests (version
/// 3 compared the doubles, and replayed one for the other); one number in
/// two spellings is one.
#[test]
fn decimals_are_compared_exactly_not_as_doubles() {
    let fp = |n: &str| Req::json(&format!(r#"{{"client_order_id":7,"amount":{n}}}"#)).fp(&none());
    for (a, b) in [
        ("1.000000000000000001", "1.000000000000000002"),
        ("1.000000000000000001", "1"),
        ("92233720368547758.07", "92233720368547758.08"),
        ("0.1", "0.10000000000000000001"),
        ("9007199254740992", "9007199254740993.0"),
    ] {
        assert_ne!(fp(a), fp(b), "{a} and {b}");
    }
    for (a, b) in [("9007199254740993", "9007199254740993.0"), ("12.50", "12.5"), ("1250e-2", "12.5"), ("-0.0", "0")] {
        assert_eq!(fp(a), fp(b), "{a} and {b}");
    }
    // A power of ten beyond 64 bits: the literal itself, never another value.
    assert_ne!(fp("1e-99999999999999999999"), fp("1e-9223372036854775808"));
    assert_eq!(fp("0.0e999999999999999999999"), fp("0"));
    assert_eq!(fp("-0e-0"), fp("0"));
    // A record written by version 3 is still recognised (its doubles).
    let v3 = |n: &str| {
        let req = Req::json(&format!(r#"{{"client_order_id":7,"amount":{n}}}"#));
        legacy_fingerprints(&none(), &req.parts()).next().expect("version 3").expect("v3")
    };
    assert_eq!(v3("1.000000000000000001"), v3("1"));
    assert_ne!(v3("1"), fp("1"));
    // A configured default is written as its shortest spelling's value.
    let spec = FingerprintSpec { defaults: vec![(JsonPointer::parse("/amount").unwrap(), serde_json::json!(12.5))], ..none() };
    assert_eq!(Req::json(r#"{"client_order_id":7}"#).fp(&spec), Req::json(r#"{"client_order_id":7,"amount":12.50}"#).fp(&spec));
}

#[test]
fn large_integers_stay_exact_and_distinct() {
    assert_eq!(
        canon("[9007199254740993, 9007199254740992, -9007199254740993, 18446744073709551615, -9223372036854775808]"),
        "[9007199254740993,9007199254740992,-9007199254740993,18446744073709551615,-9223372036854775808]"
    );
    assert_ne!(Req::json(r#"{"id": 9007199254740993}"#).fp(&none()), Req::json(r#"{"id": 9007199254740992}"#).fp(&none()));
    // Beyond 64 bits an integer literal is still exact (it used to round through a double).
    assert_eq!(canon("18446744073709551616"), "18446744073709551616");
}

#[test]
fn integers_of_any_size_are_exact_and_distinct() {
    // Issue 8 item 6: these two collided (both became the double 18446744073709552000).
    let a = Req::json(r#"{"amount":18446744073709551616}"#).fp(&none());
    let b = Req::json(r#"{"amount":18446744073709551617}"#).fp(&none());
    assert_ne!(a, b);
    assert_eq!(a, Req::json(r#"{ "amount" : 18446744073709551616 }"#).fp(&none()));
    let below = Req::json(r#"{"n":-9223372036854775809}"#).fp(&none());
    assert_ne!(below, Req::json(r#"{"n":-9223372036854775810}"#).fp(&none()));
    let huge = format!("1{}", "0".repeat(300));
    assert_eq!(
        canon(&format!("[18446744073709551617, -9223372036854775809, 123456789012345678901234567890, {huge}, -{huge}]")),
        "[18446744073709551617,-9223372036854775809,12345678901234567890123456789e1,1e300,-1e300]"
    );
    assert_ne!(Req::json(&huge).fp(&none()), Req::json(&format!("{}1", &huge[..huge.len() - 1])).fp(&none()));
    // -0 is 0 whatever its size class; fraction and exponent forms are exact too.
    assert_eq!(
        canon("[-0, 0, 1e2, 1E+2, 18446744073709551616.0, 1.8446744073709551616e19]"),
        "[0,0,1e2,1e2,18446744073709551616,18446744073709551616]"
    );
    // Big integers, floats and numbers inside strings keep the float cursor in step.
    assert_eq!(
        canon(
            r#"[18446744073709551618, "99999999999999999999 0.5", 333333333.33333329, 99999999999999999999, {"k\"1": 0.30000000000000004}]"#
        ),
        r#"[18446744073709551618,"99999999999999999999 0.5",33333333333333329e-8,99999999999999999999,{"k\"1":30000000000000004e-17}]"#
    );
    // Beyond the range of a double, serde_json refuses the literal before we see it.
    assert!(matches!(canonical_json(format!("1{}", "0".repeat(400)).as_bytes(), &none()), Err(FingerprintError::InvalidJson { .. })));
}

#[test]
fn rfc8785_section_3_2_2_example_but_for_exact_numbers() {
    let input = r#"{
        "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
        "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
        "literals": [null, true, false]
    }"#;
    assert_eq!(
        canon(input),
        r#"{"literals":[null,true,false],"numbers":[33333333333333329e-8,1e30,45e-1,2e-3,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
    );
}

#[test]
fn string_escapes_are_normalized() {
    assert_eq!(
        canon(r#"["\u0041", "\/", "\ud83d\ude00", "😀", "\u00e9", "\u001F", "\u007f", "\u2028", "\b\f\n\r\t"]"#),
        "[\"A\",\"/\",\"😀\",\"😀\",\"é\",\"\\u001f\",\"\u{7f}\",\"\u{2028}\",\"\\b\\f\\n\\r\\t\"]"
    );
    let fp = |s: &str| Req::json(s).fp(&none());
    assert_eq!(fp(r#"{"s": "\u0041"}"#), fp(r#"{"s": "A"}"#));
    assert_eq!(fp(r#"{"s": "a\/b"}"#), fp(r#"{"s": "a/b"}"#));
    assert_eq!(fp(r#"{"s": "\ud83d\ude00"}"#), fp(r#"{"s": "😀"}"#));
    assert_eq!(fp(r#"{"\u0073": 1}"#), fp(r#"{"s": 1}"#));
    assert_ne!(fp(r#"{"s": "a"}"#), fp(r#"{"s": "A"}"#));
}

#[test]
fn rfc8785_section_3_2_3_utf16_sort_example() {
    let input = r#"{
        "\u20ac": "Euro Sign",
        "\r": "Carriage Return",
        "\ufb33": "Hebrew Letter Dalet With Dagesh",
        "1": "One",
        "\ud83d\ude00": "Emoji: Grinning Face",
        "\u0080": "Control",
        "\u00f6": "Latin Small Letter O With Diaeresis"
    }"#;
    let expected = concat!(
        "{\"\\r\":\"Carriage Return\",",
        "\"1\":\"One\",",
        "\"\u{80}\":\"Control\",",
        "\"\u{f6}\":\"Latin Small Letter O With Diaeresis\",",
        "\"\u{20ac}\":\"Euro Sign\",",
        "\"\u{1f600}\":\"Emoji: Grinning Face\",",
        "\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}"
    );
    assert_eq!(canon(input), expected);
}

#[test]
fn top_level_scalars_are_documents_too() {
    assert_eq!(canon(" \"x\" "), "\"x\"");
    assert_eq!(canon("true"), "true");
    assert_eq!(canon("null"), "null");
    assert_eq!(canon("4.50"), "45e-1");
}

// ---- exclude / defaults ---------------------------------------------------------

#[test]
fn exclusions_remove_members_and_elements() {
    let spec = spec(&["/trace_id", "/meta/sent_at", "/items/0", "/absent", "/absent/deeper", "/items/7"], &[], &[]);
    assert_eq!(
        canon_with(r#"{"trace_id": "t1", "amount": 5, "meta": {"sent_at": 1, "k": 2}, "items": ["debug", "a", "b"]}"#, &spec),
        r#"{"amount":5,"items":["a","b"],"meta":{"k":2}}"#
    );
    let a = Req::json(r#"{"trace_id": "t1", "amount": 5, "meta": {"sent_at": 1}, "items": [1, 2]}"#);
    let b = Req::json(r#"{"amount": 5, "trace_id": "t2", "meta": {"sent_at": 99}, "items": [7, 2]}"#);
    let c = Req::json(r#"{"amount": 6, "trace_id": "t1", "meta": {"sent_at": 1}, "items": [1, 2]}"#);
    assert_eq!(a.fp(&spec), b.fp(&spec));
    assert_ne!(a.fp(&spec), c.fp(&spec));
    // Without the spec they differ.
    assert_ne!(a.fp(&none()), b.fp(&none()));
}

#[test]
fn excluding_an_absent_member_equals_not_sending_it() {
    let spec = spec(&["/trace_id"], &[], &[]);
    assert_eq!(Req::json(r#"{"a": 1, "trace_id": "x"}"#).fp(&spec), Req::json(r#"{"a": 1}"#).fp(&spec));
}

#[test]
fn defaults_apply_when_absent_and_equal_explicit_value() {
    let spec = spec(&[], &[("/currency", Value::from("USD"))], &[]);
    let implicit = Req::json(r#"{"amount": 5}"#);
    let explicit = Req::json(r#"{"amount": 5, "currency": "USD"}"#);
    let other = Req::json(r#"{"amount": 5, "currency": "EUR"}"#);
    let null = Req::json(r#"{"amount": 5, "currency": null}"#);
    assert_eq!(canon_with(r#"{"amount": 5}"#, &spec), r#"{"amount":5,"currency":"USD"}"#);
    assert_eq!(canon_with(r#"{"amount": 5, "currency": "EUR"}"#, &spec), r#"{"amount":5,"currency":"EUR"}"#);
    assert_eq!(implicit.fp(&spec), explicit.fp(&spec));
    assert_ne!(implicit.fp(&spec), other.fp(&spec));
    assert_ne!(implicit.fp(&spec), null.fp(&spec));
    assert_ne!(implicit.fp(&none()), explicit.fp(&none()));
}

#[test]
fn structured_defaults_are_canonicalized_too() {
    let spec = spec(&[], &[("/opts", serde_json::json!({"z": 1.0, "a": [true]}))], &[]);
    assert_eq!(canon_with("{}", &spec), r#"{"opts":{"a":[true],"z":1}}"#);
    assert_eq!(Req::json("{}").fp(&spec), Req::json(r#"{"opts": {"a": [true], "z": 1}}"#).fp(&spec));
}

#[test]
fn defaults_are_applied_before_exclusions() {
    let spec = spec(&["/sent_at"], &[("/sent_at", Value::from("now")), ("/currency", Value::from("USD"))], &[]);
    assert_eq!(canon_with(r#"{"a": 1}"#, &spec), r#"{"a":1,"currency":"USD"}"#);
    assert_eq!(canon_with(r#"{"a": 1, "sent_at": 5}"#, &spec), r#"{"a":1,"currency":"USD"}"#);
}

#[test]
fn spec_validation_bounds_default_depth() {
    let deep = |n: usize| -> Value {
        let mut v = Value::from(1);
        for _ in 0..n {
            v = Value::Array(vec![v]);
        }
        v
    };
    assert_eq!(spec(&[], &[("/a", deep(MAX_DEPTH - 1))], &[]).validate(), Ok(()));
    assert_eq!(
        spec(&[], &[("/a/b", deep(MAX_DEPTH - 1))], &[]).validate(),
        Err(SpecError::DefaultTooDeep { pointer: "/a/b".into(), depth: MAX_DEPTH + 1, limit: MAX_DEPTH })
    );
    // Such a default would otherwise fail requests at hashing time, not panic.
    let bad = spec(&[], &[("/a", deep(MAX_DEPTH))], &[]);
    assert_eq!(Req::json("{}").try_fp(&bad), Err(FingerprintError::TooDeep { limit: MAX_DEPTH }));
}

// ---- rejected bodies --------------------------------------------------------------

#[test]
fn duplicates_are_rejected_with_pointer() {
    assert_eq!(Req::json(r#"{"a": 1, "a": 1}"#).try_fp(&none()), Err(FingerprintError::DuplicateMember { pointer: "/a".into() }));
    assert_eq!(
        Req::json(r#"{"x": [{"y": 1}, {"y": 2, "z": 0, "y": 3}]}"#).try_fp(&none()),
        Err(FingerprintError::DuplicateMember { pointer: "/x/1/y".into() })
    );
    // Even inside an excluded subtree: the body itself is malformed.
    let spec = spec(&["/x"], &[], &[]);
    assert!(matches!(canonical_json(br#"{"x": {"d": 1, "d": 2}}"#, &spec), Err(FingerprintError::DuplicateMember { .. })));
}

fn nested_arrays(n: usize) -> String {
    format!("{}{}", "[".repeat(n), "]".repeat(n))
}

#[test]
fn depth_boundary_is_64_containers() {
    assert_eq!(canon(&nested_arrays(64)), nested_arrays(64));
    assert!(Req::json(&nested_arrays(64)).try_fp(&none()).is_ok());
    assert_eq!(Req::json(&nested_arrays(65)).try_fp(&none()), Err(FingerprintError::TooDeep { limit: 64 }));
    assert_eq!(canonical_json(nested_arrays(65).as_bytes(), &none()), Err(FingerprintError::TooDeep { limit: 64 }));
}

#[test]
fn ten_thousand_levels_fail_cleanly_on_the_test_thread() {
    assert_eq!(Req::json(&nested_arrays(10_000)).try_fp(&none()), Err(FingerprintError::TooDeep { limit: 64 }));
}

#[test]
fn invalid_json_bodies_are_errors_but_same_bytes_as_raw_are_fine() {
    for bad in ["{\"a\":", "{\"a\":1} trailing", "[1,,2]", "'single'", "{a:1}", "\"\\ud800\""] {
        let err = Req::json(bad).try_fp(&none());
        assert!(matches!(err, Err(FingerprintError::InvalidJson { .. })), "{bad}: {err:?}");
        assert!(Req::new(Some("text/plain"), bad.as_bytes()).try_fp(&none()).is_ok());
    }
    assert_eq!(Req::new(Some(JSON), b"{\"a\":\"\xff\"}").try_fp(&none()), Err(FingerprintError::InvalidUtf8 { valid_up_to: 6 }));
    let Err(FingerprintError::InvalidJson { line, column, .. }) = canonical_json(b"[1,\n2,\n}", &none()) else {
        panic!("expected InvalidJson");
    };
    assert_eq!((line, column), (3, 1));
}

// ---- body kinds -------------------------------------------------------------------

#[test]
fn content_type_selects_body_kind() {
    let kind = |ct: &str| body_kind(&Req::new(Some(ct), b"").headers);
    assert_eq!(kind("application/json"), BodyKind::Json);
    assert_eq!(kind("Application/JSON; charset=UTF-8"), BodyKind::Json);
    assert_eq!(kind("application/problem+json"), BodyKind::Json);
    assert_eq!(kind("application/vnd.acme.order+JSON ; v=2"), BodyKind::Json);
    assert_eq!(kind("application/x-www-form-urlencoded; charset=utf-8"), BodyKind::Form);
    assert_eq!(kind("text/plain"), BodyKind::Raw);
    assert_eq!(kind("text/json"), BodyKind::Raw);
    assert_eq!(kind("application/jsonl"), BodyKind::Raw);
    assert_eq!(kind("application/+json"), BodyKind::Raw);
    assert_eq!(kind("json"), BodyKind::Raw);
    assert_eq!(kind("multipart/form-data; boundary=x"), BodyKind::Raw);
    assert_eq!(body_kind(&HeaderMap::new()), BodyKind::Raw);
}

#[test]
fn form_bodies_are_decoded_and_sorted() {
    let f = |body: &str| Req::new(Some(FORM), body.as_bytes()).fp(&none());
    assert_eq!(f("b=2&a=1"), f("a=1&b=2"));
    assert_eq!(f("q=a+b&x=%41"), f("x=A&q=a%20b"));
    assert_eq!(f("a=1&&b=2&"), f("b=2&a=1"));
    assert_ne!(f("a=1&b=2"), f("a=1&b=3"));
    assert_ne!(f("a=1&a=2"), f("a=1"));
    assert_ne!(f("a=1&a=2"), f("a=2&a=1"));
    assert_eq!(f("a=2&b=0&a=1"), f("b=0&a=2&a=1"));
    // The same bytes as raw keep their order.
    let raw = |body: &str| Req::new(Some("text/plain"), body.as_bytes()).fp(&none());
    assert_ne!(raw("b=2&a=1"), raw("a=1&b=2"));
    // Exclusions name fields (see form_fields_take_exclusions_and_defaults).
    let s = spec(&["/a"], &[], &[]);
    assert_eq!(Req::new(Some(FORM), b"a=1").fp(&s), Req::new(Some(FORM), b"a=2").fp(&s));
}

#[test]
fn other_content_types_hash_raw_bytes() {
    let r = |ct: Option<&str>, body: &str| Req::new(ct, body.as_bytes()).fp(&none());
    assert_ne!(r(Some("text/plain"), r#"{"a":1,"b":2}"#), r(Some("text/plain"), r#"{"b":2,"a":1}"#));
    assert_ne!(r(None, "{\"a\":1}"), r(None, "{\"a\": 1}"));
    // The media type enters the hash: no content type is not octet-stream
    // (Rack reads a POST without one as a form).
    assert_ne!(r(None, "abc"), r(Some("application/octet-stream"), "abc"));
    assert_ne!(r(Some(JSON), "{\"a\":1}"), r(Some("application/merge-patch+json"), "{\"a\":1}"));
    assert_ne!(r(Some("text/plain"), "abc"), r(Some("text/csv"), "abc"));
    assert_eq!(r(Some("Application/JSON ; charset=UTF-8"), "{\"a\":1}"), r(Some(JSON), "{\"a\":1}"));
    assert_ne!(r(None, "abc"), r(None, "abd"));
    // Canonical JSON and raw bytes never collide, thanks to the body-kind tag.
    assert_ne!(r(Some(JSON), "{\"a\":1}"), r(None, "{\"a\":1}"));
    // Media type parameters alone do not change the hash.
    assert_eq!(r(Some(JSON), "{\"a\":1}"), r(Some("application/json; charset=utf-8"), "{ \"a\" : 1 }"));
}

#[test]
fn empty_body_is_empty_bytes_for_every_content_type() {
    assert_eq!(canonical_json(b"", &none()), Ok(Vec::new()));
    let e = |ct: Option<&str>| Req::new(ct, b"").fp(&none());
    let empty = e(None);
    assert_eq!(e(Some(JSON)), empty);
    assert_eq!(e(Some(FORM)), empty);
    assert_eq!(e(Some("text/plain")), empty);
    assert_ne!(Req::json("{}").fp(&none()), empty);
    assert_ne!(Req::new(Some(FORM), b"&").fp(&none()), empty);
    // Defaults do not turn an absent body into an object.
    let s = spec(&[], &[("/currency", Value::from("USD"))], &[]);
    assert_eq!(Req::json("").fp(&s), empty);
}

// ---- request line, query, headers -------------------------------------------------

#[test]
fn method_operation_and_path_params_enter_the_hash() {
    let base = Req::json("{}").params(&[("account", "7"), ("order", "9")]);
    let fp = base.fp(&none());
    let mut put = base.clone();
    put.method = Method::PUT;
    assert_ne!(put.fp(&none()), fp);
    let mut op = base.clone();
    op.operation = "cancel_order".into();
    assert_ne!(op.fp(&none()), fp);
    assert_ne!(base.clone().params(&[("account", "7"), ("order", "8")]).fp(&none()), fp);
    assert_ne!(base.clone().params(&[("order", "9"), ("account", "7")]).fp(&none()), fp);
    assert_ne!(base.clone().params(&[("account", "7")]).fp(&none()), fp);
    assert_eq!(base.clone().fp(&none()), fp);
    // Length prefixes keep field boundaries: ("ab","c") is not ("a","bc").
    assert_ne!(Req::json("{}").params(&[("ab", "c")]).fp(&none()), Req::json("{}").params(&[("a", "bc")]).fp(&none()));
    let mut shifted = Req::json("{}");
    shifted.operation = "create_orderx".into();
    assert_ne!(shifted.fp(&none()), Req::json("{}").params(&[("x", "")]).fp(&none()));
}

#[test]
fn query_is_canonicalized() {
    let q = |query: Option<&str>| Req::json("{}").query(query).fp(&none());
    assert_eq!(q(None), q(Some("")));
    assert_eq!(q(Some("b=2&a=1")), q(Some("a=1&b=2")));
    assert_eq!(q(Some("a=A+B")), q(Some("a=%41%20%42")));
    assert_eq!(q(Some("a")), q(Some("a=")));
    assert_ne!(q(Some("a=1")), q(Some("a=2")));
    assert_ne!(q(Some("a=1")), q(None));
    assert_ne!(q(Some("a=1&a=2")), q(Some("a=1")));
    assert_ne!(q(Some("a%3D1=")), q(Some("a=1")));
    // One name's values are a list: their order counts; other names' order does not.
    assert_ne!(q(Some("tag=a&tag=b")), q(Some("tag=b&tag=a")));
    assert_eq!(q(Some("tag=b&x=1&tag=a")), q(Some("x=1&tag=b&tag=a")));
    assert_ne!(q(Some("tag=b&x=1&tag=a")), q(Some("x=1&tag=a&tag=b")));
}

#[test]
fn only_listed_headers_enter_the_hash() {
    let s = spec(&[], &[], &["api-version"]);
    let base = Req::json("{}").header("api-version", "2024-01-01").header("x-request-id", "r1");
    let fp = base.fp(&s);
    assert_ne!(Req::json("{}").header("api-version", "2025-01-01").header("x-request-id", "r1").fp(&s), fp);
    assert_eq!(Req::json("{}").header("api-version", "2024-01-01").header("x-request-id", "r2").fp(&s), fp);
    // Unlisted, it does not matter.
    assert_eq!(
        Req::json("{}").header("api-version", "2025-01-01").fp(&none()),
        Req::json("{}").header("api-version", "2024-01-01").fp(&none())
    );
    // Header names are case-insensitive.
    assert_eq!(Req::json("{}").header("API-Version", "2024-01-01").fp(&s), fp);
}

#[test]
fn absent_header_differs_from_empty_and_values_join_in_order() {
    let s = spec(&[], &[], &["api-version"]);
    let absent = Req::json("{}").fp(&s);
    let empty = Req::json("{}").header("api-version", "").fp(&s);
    assert_ne!(absent, empty);
    let two_lines = Req::json("{}").header("api-version", "a").header("api-version", "b").fp(&s);
    let one_line = Req::json("{}").header("api-version", "a, b").fp(&s);
    let reversed = Req::json("{}").header("api-version", "b").header("api-version", "a").fp(&s);
    assert_eq!(two_lines, one_line);
    assert_ne!(two_lines, reversed);
    // A spec listing a header the request lacks still differs from one that lists none.
    assert_ne!(absent, Req::json("{}").fp(&none()));
}

// ---- the Fingerprint value and the exact encoding ---------------------------------

#[test]
fn encoding_matches_the_documented_layout() {
    fn field(s: &mut Vec<u8>, bytes: &[u8]) {
        s.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        s.extend_from_slice(bytes);
    }
    fn count(s: &mut Vec<u8>, n: u64) {
        s.extend_from_slice(&n.to_be_bytes());
    }
    let mut s = Vec::new();
    field(&mut s, b"idemgate-fp-v4");
    field(&mut s, b"POST");
    field(&mut s, b"create_order");
    count(&mut s, 1);
    field(&mut s, b"id");
    field(&mut s, b"42");
    count(&mut s, 2);
    for f in [&b"a"[..], b"1 x", b"b", b"2"] {
        field(&mut s, f);
    }
    count(&mut s, 2);
    field(&mut s, b"api-version");
    s.push(1);
    field(&mut s, b"v1, v2");
    field(&mut s, b"x-absent");
    s.push(0);
    field(&mut s, b"application/json");
    field(&mut s, b"json");
    s.extend_from_slice(br#"{"a":[true,15e-1],"b":"\u0001"}"#);
    let expected: [u8; 32] = Sha256::digest(&s).into();

    let req = Req::json("{\"b\": \"\\u0001\", \"a\": [true, 15e-1], \"t\": 0}")
        .params(&[("id", "42")])
        .query(Some("b=2&a=1+x"))
        .header("api-version", "v1")
        .header("api-version", "v2");
    let spec = spec(&["/t"], &[], &["api-version", "x-absent"]);
    assert_eq!(req.fp(&spec), Fingerprint(expected));

    // Raw bodies are length-prefixed.
    let mut s = Vec::new();
    field(&mut s, b"idemgate-fp-v4");
    field(&mut s, b"GET");
    field(&mut s, b"op");
    count(&mut s, 0);
    count(&mut s, 0);
    count(&mut s, 0);
    field(&mut s, b"");
    field(&mut s, b"raw");
    field(&mut s, b"hello");
    let expected: [u8; 32] = Sha256::digest(&s).into();
    let mut req = Req::new(None, b"hello");
    req.method = Method::GET;
    req.operation = "op".into();
    assert_eq!(req.fp(&none()), Fingerprint(expected));

    // Multipart bodies: a count, then each part between the delimiters.
    let mut s = Vec::new();
    field(&mut s, b"idemgate-fp-v4");
    field(&mut s, b"GET");
    field(&mut s, b"op");
    count(&mut s, 0);
    count(&mut s, 0);
    count(&mut s, 0);
    field(&mut s, b"multipart/form-data");
    field(&mut s, b"multipart");
    count(&mut s, 3);
    for part in [&b""[..], b"\r\n\r\nx\r\n", b"--\r\n"] {
        field(&mut s, part);
    }
    let expected: [u8; 32] = Sha256::digest(&s).into();
    let mut req = Req::new(Some("multipart/form-data; boundary=B"), b"--B\r\n\r\nx\r\n--B--\r\n");
    req.method = Method::GET;
    req.operation = "op".into();
    assert_eq!(req.fp(&none()), Fingerprint(expected));
}

#[test]
fn fingerprint_displays_and_parses_as_lowercase_hex() {
    let fp = Req::json("{}").fp(&none());
    let text = fp.to_string();
    assert_eq!(text.len(), 64);
    assert!(text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')), "{text}");
    assert_eq!(text, hex::encode(fp.as_bytes()));
    assert_eq!(text, fp.to_hex());
    assert_eq!(text.parse::<Fingerprint>(), Ok(fp));
    assert_eq!(text.to_uppercase().parse::<Fingerprint>(), Ok(fp));
    assert!("abc".parse::<Fingerprint>().is_err());
    assert!("zz".repeat(32).parse::<Fingerprint>().is_err());
    let known = Fingerprint([0xab; 32]);
    assert_eq!(known.to_string(), "ab".repeat(32));
    assert_eq!(known.as_bytes(), &[0xab; 32]);
}

#[test]
fn fingerprint_is_deterministic_and_matches_canonical_json() {
    let body = r#"{"z": [1.0, {"b": null, "a": "\u00e9"}], "a": 1}"#;
    let a = Req::json(body).fp(&none());
    let b = Req::json(body).fp(&none());
    assert_eq!(a, b);
    // The hashed JSON is exactly canonical_json's output.
    let canonical = canon(body);
    assert_eq!(Req::json(&canonical).fp(&none()), a);
    assert_eq!(canonical, r#"{"a":1,"z":[1,{"a":"é","b":null}]}"#);
}

/// Version 1 sorted pairs by (name, value); `legacy_fingerprint` still computes it, so
/// records it wrote are recognised. Its encoding is version 2's but for the tag and
/// that order.
#[test]
fn the_legacy_fingerprint_is_version_1s_encoding() {
    fn field(s: &mut Vec<u8>, bytes: &[u8]) {
        s.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
        s.extend_from_slice(bytes);
    }
    let layout = |tag: &[u8], pairs: &[&[u8]], form: &[&[u8]]| {
        let mut s = Vec::new();
        field(&mut s, tag);
        field(&mut s, b"POST");
        field(&mut s, b"create_order");
        s.extend_from_slice(&0u64.to_be_bytes());
        s.extend_from_slice(&(pairs.len() as u64 / 2).to_be_bytes());
        for f in pairs {
            field(&mut s, f);
        }
        s.extend_from_slice(&0u64.to_be_bytes());
        field(&mut s, b"form");
        s.extend_from_slice(&(form.len() as u64 / 2).to_be_bytes());
        for f in form {
            field(&mut s, f);
        }
        Fingerprint(Sha256::digest(&s).into())
    };
    let req = Req::new(Some(FORM), b"k=2&k=1").query(Some("tag=b&tag=a"));
    let parts = RequestParts {
        method: &req.method,
        operation: &req.operation,
        path_params: &req.params,
        query: req.query.as_deref(),
        headers: &req.headers,
        body: &req.body,
    };
    let v1 = legacy_fingerprint(&none(), &parts).expect("v1");
    assert_eq!(v1, layout(b"idemgate-fp-v1", &[b"tag", b"a", b"tag", b"b"], &[b"k", b"1", b"k", b"2"]));
    let earlier: Vec<Fingerprint> = legacy_fingerprints(&none(), &parts).map(|fp| fp.expect("earlier")).collect();
    let v2 = layout(b"idemgate-fp-v2", &[b"tag", b"b", b"tag", b"a"], &[b"k", b"2", b"k", b"1"]);
    assert_eq!(earlier[1..], [v2, v1]);
    assert_ne!(req.fp(&none()), v2, "version 3 and after hash the media type too");
    // Without a repeated name the two differ by their tag only.
    let plain = Req::json("{}").query(Some("b=1&a=2"));
    let parts = RequestParts { query: plain.query.as_deref(), headers: &plain.headers, body: &plain.body, ..parts };
    assert_ne!(legacy_fingerprint(&none(), &parts).expect("v1"), plain.fp(&none()));
}

#[test]
fn a_spec_reads_back_from_its_text() {
    let specs = [
        FingerprintSpec::default(),
        spec(
            &["/trace_id", "/items/0/~1x"],
            &[("/currency", serde_json::json!("USD")), ("/opts", serde_json::json!({"a": [1, null]}))],
            &["api-version", "x-tenant"],
        ),
    ];
    for s in specs {
        let text = s.to_text();
        assert_eq!(FingerprintSpec::from_text(&text), Ok(s.clone()), "{text}");
        assert_eq!(FingerprintSpec::from_text(&text).unwrap().to_text(), text, "equal specs give equal texts");
    }
    for bad in [
        "",
        "[]",
        r#"{"exclude":[1],"defaults":[],"headers":[]}"#,
        r#"{"exclude":[],"defaults":[["/a"]],"headers":[]}"#,
        r#"{"exclude":["x"],"defaults":[],"headers":[]}"#,
        r#"{"exclude":[],"defaults":[],"headers":["bad header"]}"#,
    ] {
        assert!(FingerprintSpec::from_text(bad).is_err(), "{bad}");
    }
}
