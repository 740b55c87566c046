//! Command-line words and numbers: decimal or 0x-hex, sizes with K/M/G (powers of 1024).

pub struct Words<'a> {
    inner: core::str::SplitAsciiWhitespace<'a>,
}

impl<'a> Words<'a> {
    pub fn new(cmdline: &'a str) -> Words<'a> {
        Words {
            inner: cmdline.split_ascii_whitespace(),
        }
    }

    pub fn next_word(&mut self) -> Option<&'a str> {
        self.inner.next()
    }
}

pub fn parse_number(text: &str) -> Option<u64> {
    if let Some(hex) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        u64::from_str_radix(hex, 16).ok()
    } else {
        text.parse().ok()
    }
}

pub fn parse_size(text: &str) -> Option<u64> {
    let (digits, shift) = match text.as_bytes().last()? {
        b'K' | b'k' => (&text[..text.len() - 1], 10),
        b'M' | b'm' => (&text[..text.len() - 1], 20),
        b'G' | b'g' => (&text[..text.len() - 1], 30),
        _ => (text, 0),
    };
    // Hex digits include no K/M/G, so a trailing letter is always a suffix.
    parse_number(digits)?.checked_mul(1u64 << shift)
}
