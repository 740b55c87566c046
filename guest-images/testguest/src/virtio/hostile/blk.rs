//! Attacks on the block device (type 2), and its good request: sector 0 read (the magic),
//! the scratch sector written and read back.

use super::driver::D;
use super::memory::{fill, get8, mmio_read, put32, put64, put8};
use super::session::Session;
use super::{fail, Outcome, Text, DATA, DATA2, HDR, HUGE, OUTSIDE, STATUS};
use crate::virtio::blk::{MAGIC, T_IN, T_OUT};

const T_DISCARD: u32 = 11;
const T_WRITE_ZEROES: u32 = 13;
/// The one sector the good block request writes (the host test leaves it out of its
/// comparison); the attacks aim their refused writes at sectors 16, 20 and 24.
pub const BLK_SCRATCH_SECTOR: u64 = 1;

impl Session {
    /// Block request: header at HDR, `data` between it and the status byte.
    pub(super) fn blk_request(&mut self, kind: u32, sector: u64, data: D) -> Result<u8, Text> {
        blk_header(kind, sector);
        put8(STATUS, 0xff);
        let ring = self.attack_ring();
        ring.set_desc(ring.desc, 0, D::r(HDR, 16).to(1));
        ring.set_desc(ring.desc, 1, data.to(2));
        ring.set_desc(ring.desc, 2, D::w(STATUS, 1));
        match self.good_request(0) {
            Some(_) => Ok(get8(STATUS)),
            None => Err(text!("request type {kind} sector {sector} not answered")),
        }
    }

    /// Reads sector 0 (the magic), writes the scratch sector and reads it back.
    pub(super) fn good_blk(&mut self) -> Result<(), Text> {
        fill(DATA, 512, 0);
        let status = self.blk_request(T_IN, 0, D::w(DATA, 512))?;
        let mut magic = [0u8; 8];
        for (i, byte) in magic.iter_mut().enumerate() {
            *byte = get8(DATA + i as u64);
        }
        if status != 0 || &magic != MAGIC {
            return Err(text!("read sector 0: status {status}, magic {:?}", magic));
        }
        let seed = 0x4057_11e0_0000 + u64::from(self.checks);
        for word in 0..64 {
            put64(DATA + 8 * word, crate::pattern::pattern(seed, word));
        }
        let status = self.blk_request(T_OUT, BLK_SCRATCH_SECTOR, D::r(DATA, 512))?;
        if status != 0 {
            return Err(text!("write sector {BLK_SCRATCH_SECTOR}: status {status}"));
        }
        fill(DATA2, 512, 0);
        let status = self.blk_request(T_IN, BLK_SCRATCH_SECTOR, D::w(DATA2, 512))?;
        if status != 0 {
            return Err(text!("read sector {BLK_SCRATCH_SECTOR}: status {status}"));
        }
        for word in 0..64 {
            let got = mmio_read(DATA2 + 8 * word, 8);
            if got != crate::pattern::pattern(seed, word) {
                return Err(text!(
                    "sector {BLK_SCRATCH_SECTOR} reads back {got:#x} at word {word}"
                ));
            }
        }
        Ok(())
    }
}

/// Attacks on the block device: requests it has to refuse, and malformed chains.
pub(super) fn attacks(s: &mut Session, n: &mut u32) {
    // (name, request type, sector, data descriptor, status that would be wrong)
    type Sector = fn(&Session) -> u64;
    let cases: [(&str, u32, Sector, D); 7] = [
        ("read past the end", T_IN, |s| s.capacity, D::w(DATA, 512)),
        (
            "read straddling the end",
            T_IN,
            |s| s.capacity - 1,
            D::w(DATA, 1024),
        ),
        ("read at sector 2^64-1", T_IN, |_| u64::MAX, D::w(DATA, 512)),
        ("write past the end", T_OUT, |s| s.capacity, D::r(DATA, 512)),
        (
            "read of 100 bytes (not a multiple of 512)",
            T_IN,
            |_| 0,
            D::w(DATA, 100),
        ),
        (
            "write of 100 bytes at sector 16",
            T_OUT,
            |_| 16,
            D::r(DATA, 100),
        ),
        (
            "write at sector 24 from a buffer outside RAM",
            T_OUT,
            |_| 24,
            D::r(OUTSIDE, 512),
        ),
    ];
    for (name, kind, sector, data) in cases {
        s.attack(n, name, |s| {
            fill(DATA, 1024, 0x5a);
            let sector = sector(s);
            blk_header(kind, sector);
            put8(STATUS, 0xff);
            let outcome = s.submit(&[D::r(HDR, 16).to(1), data.to(2), D::w(STATUS, 1)], 0);
            blk_expect_error(s, name, outcome)
        });
    }
    s.attack(
        n,
        "write at sector 20 with a read-only status descriptor",
        |s| {
            fill(DATA, 512, 0x5a);
            blk_header(T_OUT, 20);
            put8(STATUS, 0xff);
            // STATUS is not device-writable here: a status written into it fails the check.
            s.submit(
                &[D::r(HDR, 16).to(1), D::r(DATA, 512).to(2), D::r(STATUS, 1)],
                0,
            )
        },
    );
    s.attack(n, "status byte outside RAM", |s| {
        blk_header(T_IN, 0);
        put8(STATUS, 0xff);
        s.submit(
            &[D::r(HDR, 16).to(1), D::w(DATA, 512).to(2), D::w(OUTSIDE, 1)],
            0,
        )
    });
    s.attack(n, "readable descriptor after a writable one", |s| {
        blk_header(T_OUT, 16);
        put8(STATUS, 0xff);
        let outcome = s.submit(
            &[
                D::r(HDR, 16).to(1),
                D::w(DATA, 512).to(2),
                D::r(DATA2, 512).to(3),
                D::w(STATUS, 1),
            ],
            0,
        );
        blk_expect_error(s, "readable after writable", outcome)
    });
    s.attack(n, "header of 8 bytes", |s| {
        blk_header(T_IN, 0);
        put8(STATUS, 0xff);
        let outcome = s.submit(&[D::r(HDR, 8).to(1), D::w(STATUS, 1)], 0);
        blk_expect_error(s, "short header", outcome)
    });
    s.attack(n, "unknown request type 0x7fffffff", |s| {
        blk_header(0x7fff_ffff, 0);
        put8(STATUS, 0xff);
        let outcome = s.submit(
            &[D::r(HDR, 16).to(1), D::w(DATA, 512).to(2), D::w(STATUS, 1)],
            0,
        );
        blk_expect_error(s, "unknown type", outcome)
    });
    s.attack(n, "discard of 2^32-1 sectors from the last one", |s| {
        blk_header(T_DISCARD, 0);
        put64(DATA, s.capacity - 1);
        put32(DATA + 8, u32::MAX);
        put32(DATA + 12, 0);
        put8(STATUS, 0xff);
        let outcome = s.submit(
            &[D::r(HDR, 16).to(1), D::r(DATA, 16).to(2), D::w(STATUS, 1)],
            0,
        );
        blk_expect_error(s, "discard", outcome)
    });
    s.attack(
        n,
        "write zeroes of 2^32-1 sectors with unknown flags",
        |s| {
            blk_header(T_WRITE_ZEROES, 0);
            put64(DATA, 0);
            put32(DATA + 8, u32::MAX);
            put32(DATA + 12, 0xffff_fffe);
            put8(STATUS, 0xff);
            let outcome = s.submit(
                &[D::r(HDR, 16).to(1), D::r(DATA, 16).to(2), D::w(STATUS, 1)],
                0,
            );
            blk_expect_error(s, "write zeroes", outcome)
        },
    );
    s.attack(n, "discard with 2^20 segments", |s| {
        blk_header(T_DISCARD, 0);
        put8(STATUS, 0xff);
        fill(HUGE, 1 << 20, 0);
        let outcome = s.submit(
            &[
                D::r(HDR, 16).to(1),
                D::r(HUGE, 1 << 20).to(2),
                D::w(STATUS, 1),
            ],
            0,
        );
        blk_expect_error(s, "discard segments", outcome)
    });
}

/// A block request that had to fail must not have answered OK.
fn blk_expect_error(s: &Session, name: &str, outcome: Outcome) -> Outcome {
    if get8(STATUS) == 0 {
        fail(format_args!(
            "blk {name}: answered status 0 (OK) for a request it had to refuse (capacity {} sectors)",
            s.capacity
        ));
    }
    outcome
}

pub(super) fn blk_header(kind: u32, sector: u64) {
    put32(HDR, kind);
    put32(HDR + 4, 0);
    put64(HDR + 8, sector);
}
