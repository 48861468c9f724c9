//! Encoding of stored response headers (one `bytea`/`BLOB` column).
//!
//! Format, version 1: a `0x01` byte, then per header a big-endian `u16` name
//! length, the name, a big-endian `u32` value length and the raw value bytes.
//! Header values need not be UTF-8, so JSON would be lossy; `keys show`
//! decodes this for operators.

use super::StoreError;

const VERSION: u8 = 1;

pub fn encode_headers(headers: &[(String, Vec<u8>)]) -> Vec<u8> {
    let len = 1 + headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum::<usize>();
    let mut out = Vec::with_capacity(len);
    out.push(VERSION);
    for (name, value) in headers {
        // Names and values come from hyper's HeaderMap, far below these limits.
        let n = u16::try_from(name.len()).unwrap_or(u16::MAX);
        let v = u32::try_from(value.len()).unwrap_or(u32::MAX);
        out.extend_from_slice(&n.to_be_bytes());
        out.extend_from_slice(&name.as_bytes()[..n as usize]);
        out.extend_from_slice(&v.to_be_bytes());
        out.extend_from_slice(&value[..v as usize]);
    }
    out
}

pub fn decode_headers(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
    let bad = |what: &str| StoreError::Corrupt(format!("stored headers: {what}"));
    let (&version, mut rest) = bytes.split_first().ok_or_else(|| bad("empty"))?;
    if version != VERSION {
        return Err(bad("unknown encoding version"));
    }
    let mut out = Vec::new();
    while !rest.is_empty() {
        let (n, r) = take(rest, 2).ok_or_else(|| bad("truncated name length"))?;
        let n = u16::from_be_bytes([n[0], n[1]]) as usize;
        let (name, r) = take(r, n).ok_or_else(|| bad("truncated name"))?;
        let (v, r) = take(r, 4).ok_or_else(|| bad("truncated value length"))?;
        let v = u32::from_be_bytes([v[0], v[1], v[2], v[3]]) as usize;
        let (value, r) = take(r, v).ok_or_else(|| bad("truncated value"))?;
        let name = std::str::from_utf8(name).map_err(|_| bad("name is not UTF-8"))?;
        out.push((name.to_owned(), value.to_vec()));
        rest = r;
    }
    Ok(out)
}

fn take(b: &[u8], n: usize) -> Option<(&[u8], &[u8])> {
    (b.len() >= n).then(|| b.split_at(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corruption() {
        let h = vec![("content-type".to_owned(), b"application/json".to_vec()), ("x-bin".to_owned(), vec![0xff, 0x00, 0x80])];
        let enc = encode_headers(&h);
        assert_eq!(decode_headers(&enc).unwrap(), h);
        assert_eq!(decode_headers(&encode_headers(&[])).unwrap(), vec![]);
        assert!(decode_headers(&[]).is_err());
        assert!(decode_headers(&[2]).is_err());
        for cut in 1..enc.len() {
            // Every strict prefix that ends inside a header is rejected, never a panic.
            let r = decode_headers(&enc[..cut]);
            let ends_on_boundary = cut == 1 || cut == 1 + 2 + 12 + 4 + 16;
            assert_eq!(r.is_ok(), ends_on_boundary, "cut at {cut}");
        }
    }
}
