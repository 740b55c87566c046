//! Descriptor-chain attacks every device gets on its attacked queue: loops, out-of-range
//! indices, buffers outside RAM, huge and empty lengths, a runaway available index, and
//! malformed indirect tables.

use super::driver::{D, DESC_F_INDIRECT, F_INDIRECT_DESC};
use super::session::Session;
use super::{AREA_LEN, AREA_START, HUGE, INDIRECT, OUTSIDE};
use crate::virtio::queue::DESC_F_WRITE;

/// With `storm`: a ring whose available index is far ahead, notified 100000 times (a
/// device must not log every look at it).
fn chain_storm(s: &mut Session, n: &mut u32) {
    s.attack(n, "avail index 50000 ahead, notified 100000 times", |s| {
        let t = s.template();
        let d = t.linked();
        let table = s.attack_ring().desc;
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(table, i as u32, entry);
        }
        let next = s.attack_ring().next_avail;
        let outcome = s.offer_and_classify(0, Some(next.wrapping_add(50_000)));
        let ring = s.attack_ring();
        for _ in 0..100_000 {
            ring.notify();
        }
        outcome
    });
}

/// Chain attacks every device gets, on its attacked queue.
pub(super) fn attacks(s: &mut Session, n: &mut u32) {
    s.attack(n, "descriptor loop (last next -> head)", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.n - 1] = d[t.n - 1].to(0);
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "descriptor pointing at itself", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[0] = d[0].to(0);
        s.submit(&d[..t.n], 0)
    });
    s.attack(
        n,
        "chain through every descriptor, last next out of range",
        |s| {
            let t = s.template();
            let ring = s.attack_ring();
            let size = ring.size;
            for i in 0..size {
                let d = if i == 0 { t.d[0] } else { t.d[t.n - 1] };
                s.desc(ring.desc, u32::from(i), d.to(i + 1));
            }
            s.offer_and_classify(0, None)
        },
    );
    s.attack(n, "next index 0xffff", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[0] = d[0].to(0xffff);
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "head index out of range", |s| {
        let t = s.template();
        let d = t.linked();
        let size = s.attack_ring().size;
        s.submit(&d[..t.n], size)
    });
    s.attack(n, "buffer outside RAM (0xffff_ffff_f000)", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].addr = OUTSIDE;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "buffer straddling the end of RAM", |s| {
        let t = s.template();
        let mut d = t.linked();
        let len = u64::from(d[t.payload].len);
        d[t.payload].addr = s.ram_end - len / 2;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "buffer in the device's own BAR", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].addr = s.dev.bar0;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "buffer address wrapping past 2^64", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].addr = u64::MAX - 7;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "length 0xffff_ffff", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].addr = HUGE;
        d[t.payload].len = u32::MAX;
        if d[t.payload].flags & DESC_F_WRITE != 0 {
            s.allow(HUGE, AREA_START + AREA_LEN - HUGE);
        }
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "zero length", |s| {
        let t = s.template();
        let mut d = t.linked();
        d[t.payload].len = 0;
        s.submit(&d[..t.n], 0)
    });
    s.attack(n, "avail index 50000 ahead", |s| {
        let t = s.template();
        let d = t.linked();
        let table = s.attack_ring().desc;
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(table, i as u32, entry);
        }
        let next = s.attack_ring().next_avail;
        s.offer_and_classify(0, Some(next.wrapping_add(50_000)))
    });

    if s.storm {
        chain_storm(s, n);
    }

    let negotiated = s.features & F_INDIRECT_DESC != 0;
    let suffix = if negotiated { "" } else { " (not negotiated)" };
    let name = text!("indirect table outside RAM{suffix}");
    s.attack(n, name.as_str(), |s| {
        let t = s.template();
        s.submit(&[D::r(OUTSIDE, 16 * t.n as u32).flag(DESC_F_INDIRECT)], 0)
    });
    for (entries, label) in [
        (65_535u32, "indirect chain of 65535 descriptors"),
        (65_536, "indirect table of 2^16 descriptors"),
    ] {
        let name = text!("{label}{suffix}");
        s.attack(n, name.as_str(), |s| {
            let t = s.template();
            for i in 0..entries {
                let d = if i == 0 { t.d[0] } else { t.d[t.n - 1] };
                let d = if i + 1 < entries {
                    d.to((i + 1) as u16)
                } else {
                    d
                };
                s.desc(INDIRECT, i, d);
            }
            s.submit(&[D::r(INDIRECT, 16 * entries).flag(DESC_F_INDIRECT)], 0)
        });
    }
    let name = text!("indirect descriptor inside an indirect table{suffix}");
    s.attack(n, name.as_str(), |s| {
        let t = s.template();
        let d = t.linked();
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(INDIRECT + 0x1000, i as u32, entry);
        }
        s.desc(
            INDIRECT,
            0,
            D::r(INDIRECT + 0x1000, 16 * t.n as u32).flag(DESC_F_INDIRECT),
        );
        s.submit(&[D::r(INDIRECT, 16).flag(DESC_F_INDIRECT)], 0)
    });
    let name = text!("indirect table length not a multiple of 16{suffix}");
    s.attack(n, name.as_str(), |s| {
        let t = s.template();
        let d = t.linked();
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(INDIRECT, i as u32, entry);
        }
        s.submit(
            &[D::r(INDIRECT, 16 * t.n as u32 + 8).flag(DESC_F_INDIRECT)],
            0,
        )
    });
    let name = text!("indirect descriptor with NEXT{suffix}");
    s.attack(n, name.as_str(), |s| {
        let t = s.template();
        let d = t.linked();
        for (i, &entry) in d.iter().enumerate().take(t.n) {
            s.desc(INDIRECT, i as u32, entry);
        }
        s.submit(
            &[
                D::r(INDIRECT, 16 * t.n as u32).flag(DESC_F_INDIRECT).to(1),
                t.d[t.n - 1],
            ],
            0,
        )
    });
}
