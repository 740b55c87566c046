//! Attacks on the entropy device (type 4), and its good request: 64 bytes.

use super::driver::D;
use super::memory::fill;
use super::session::Session;
use super::{fail, Text, DATA, HUGE};

impl Session {
    pub(super) fn good_rng(&mut self) -> Result<(), Text> {
        fill(DATA, 64, 0);
        let ring = self.attack_ring();
        ring.set_desc(ring.desc, 0, D::w(DATA, 64));
        match self.good_request(0) {
            Some((_, len)) if (1..=64).contains(&len) => Ok(()),
            Some((_, len)) => Err(text!("{len} bytes for a 64-byte buffer")),
            None => Err(text!("no answer")),
        }
    }
}

/// Attacks on the entropy device: read-only and oversized buffers.
pub(super) fn attacks(s: &mut Session, n: &mut u32) {
    s.attack(n, "read-only buffer", |s| {
        fill(DATA, 64, 0x5a);
        s.submit(&[D::r(DATA, 64)], 0)
    });
    s.attack(n, "64 KiB + 1 in one descriptor", |s| {
        let outcome = s.submit(&[D::w(HUGE, 0x1_0001)], 0);
        let used = s
            .attack_ring()
            .used_element(s.attack_ring().used_index().wrapping_sub(1));
        if !outcome.reset && used.1 > 0x1_0001 {
            fail(format_args!(
                "rng: the device says it wrote {} bytes into 65537",
                used.1
            ));
        }
        outcome
    });
    s.attack(n, "read-only and writable descriptors interleaved", |s| {
        let d = [
            D::r(DATA, 16).to(1),
            D::w(DATA + 64, 16).to(2),
            D::r(DATA + 128, 16).to(3),
            D::w(DATA + 192, 16),
        ];
        let outcome = s.submit(&d, 0);
        let used = s
            .attack_ring()
            .used_element(s.attack_ring().used_index().wrapping_sub(1));
        if !outcome.reset && used.1 > 32 {
            fail(format_args!(
                "rng: the device says it wrote {} bytes into 32",
                used.1
            ));
        }
        outcome
    });
}
