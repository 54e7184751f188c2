//! Generators of what comes off the wire, for the adapters' conversion fuzz tests: every
//! adapter must turn any header name and value its broker lets through into an envelope
//! without losing or panicking, and these are the shapes that trip conversions.

use rand::Rng;

/// Bytes of the shapes producers send: empty, ASCII, UTF-8 with multi-byte characters,
/// arbitrary (mostly not UTF-8), text with NULs and stray non-UTF-8 bytes, and now and then
/// large (up to 200 kB).
pub fn bytes(rng: &mut impl Rng) -> Vec<u8> {
    let len = match rng.gen_range(0..100) {
        0..=9 => 0,
        10..=94 => rng.gen_range(1..40),
        95..=98 => rng.gen_range(40..4_000),
        _ => rng.gen_range(4_000..200_000),
    };
    let mut out = vec![0u8; len];
    match rng.gen_range(0..4) {
        0 => {
            rng.fill(&mut out[..]);
            out.iter_mut().for_each(|b| *b = b' ' + *b % 95);
        }
        1 => {
            let s: String = (0..len.min(64))
                .map(|_| ['a', '\u{e9}', '\u{20ac}', '\u{1d11e}', '\\', 'x'][rng.gen_range(0..6)])
                .collect();
            out = s.repeat(len / 64 + 1).into_bytes();
        }
        2 => rng.fill(&mut out[..]),
        _ => {
            // Mostly text, with single bytes that are not UTF-8 and NULs in it.
            rng.fill(&mut out[..]);
            for b in out.iter_mut() {
                *b = match *b % 8 {
                    0 => 0x80 | *b,
                    1 => 0,
                    _ => b'a' + *b % 26,
                };
            }
        }
    }
    out
}

/// Text with the characters that trip conversions: empty, NUL, the control characters
/// RocketMQ separates properties with, spaces (its `KEYS` separator), quotes and
/// backslashes, multi-byte characters; up to `max` characters.
pub fn text(rng: &mut impl Rng, max: usize) -> String {
    const CHARS: [char; 12] = [
        'a',
        'Z',
        '0',
        ' ',
        '\0',
        '\u{1}',
        '\u{2}',
        '"',
        '\\',
        '\u{e9}',
        '\u{20ac}',
        '\u{1d11e}',
    ];
    let len = match rng.gen_range(0..10) {
        0 => 0,
        1..=8 => rng.gen_range(1..16),
        _ => rng.gen_range(16..=max.max(16)),
    };
    (0..len.min(max))
        .map(|_| CHARS[rng.gen_range(0..CHARS.len())])
        .collect()
}
