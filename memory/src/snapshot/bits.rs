//! Small page bitmaps (one bit per linear page).

use std::sync::atomic::{AtomicU64, Ordering};

/// A plain bitmap.
pub(crate) struct Bitmap {
    words: Vec<u64>,
}

impl Bitmap {
    pub fn new(bits: u64) -> Bitmap {
        Bitmap {
            words: vec![0; bits.div_ceil(64) as usize],
        }
    }

    /// Sets bits `start..end`.
    pub fn set_range(&mut self, start: u64, end: u64) {
        let mut bit = start;
        while bit < end {
            let in_word = bit % 64;
            let n = (64 - in_word).min(end - bit);
            let mask = if n == 64 {
                !0
            } else {
                ((1u64 << n) - 1) << in_word
            };
            self.words[(bit / 64) as usize] |= mask;
            bit += n;
        }
    }

    /// First bit in `from..end` equal to `value`, or `end`.
    pub fn next(&self, value: bool, from: u64, end: u64) -> u64 {
        next_in_words(|i| self.words[i], value, from, end)
    }
}

/// A bitmap shared between threads; bits are only ever set.
pub(crate) struct AtomicBitmap {
    words: Vec<AtomicU64>,
}

impl AtomicBitmap {
    pub fn new(bits: u64) -> AtomicBitmap {
        AtomicBitmap {
            words: (0..bits.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub fn get(&self, bit: u64) -> bool {
        self.words[(bit / 64) as usize].load(Ordering::Acquire) & (1 << (bit % 64)) != 0
    }

    /// Sets bits `start..end`; returns how many were newly set.
    pub fn set_range(&self, start: u64, end: u64) -> u64 {
        let mut bit = start;
        let mut newly = 0;
        while bit < end {
            let in_word = bit % 64;
            let n = (64 - in_word).min(end - bit);
            let mask = if n == 64 {
                !0
            } else {
                ((1u64 << n) - 1) << in_word
            };
            let old = self.words[(bit / 64) as usize].fetch_or(mask, Ordering::AcqRel);
            newly += u64::from((mask & !old).count_ones());
            bit += n;
        }
        newly
    }

    /// First bit in `from..end` equal to `value`, or `end`.
    pub fn next(&self, value: bool, from: u64, end: u64) -> u64 {
        next_in_words(|i| self.words[i].load(Ordering::Acquire), value, from, end)
    }
}

fn next_in_words(word: impl Fn(usize) -> u64, value: bool, from: u64, end: u64) -> u64 {
    let mut bit = from;
    while bit < end {
        let w = word((bit / 64) as usize);
        let w = if value { w } else { !w };
        let w = w >> (bit % 64);
        if w != 0 {
            return (bit + u64::from(w.trailing_zeros())).min(end);
        }
        bit = (bit / 64 + 1) * 64;
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_search() {
        let mut b = Bitmap::new(200);
        b.set_range(3, 130);
        assert_eq!(b.next(true, 0, 200), 3);
        assert_eq!(b.next(false, 3, 200), 130);
        assert_eq!(b.next(true, 130, 200), 200);
        assert_eq!(b.next(false, 0, 2), 0);

        let a = AtomicBitmap::new(200);
        assert_eq!(a.set_range(60, 70), 10);
        assert_eq!(a.set_range(0, 128), 118);
        assert_eq!(a.next(false, 0, 200), 128);
        assert_eq!(a.next(true, 128, 200), 200);
        assert!(a.get(127) && !a.get(128));
    }
}
