//! A descriptor chain parsed and checked into a request, without trusting anything in it.
//!
//! Layout (virtio 1.x, 5.2.6): device-readable bytes (the 16-byte header, then the data of
//! OUT or the segments of DISCARD / WRITE_ZEROES), then device-writable bytes (the data of
//! IN or GET_ID, then the status byte, the chain's last byte). Descriptor boundaries carry
//! no meaning: the header may be split, data may share a descriptor with the status byte.
//! The only rule enforced on descriptors is the spec's: readable ones come first, and the
//! last one is writable (it holds the status byte); a chain without a place for a status is
//! dropped (returned with 0 bytes written), anything else wrong is answered with a status.

use std::io::Read;

use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_S_IOERR, VIRTIO_BLK_S_OK, VIRTIO_BLK_S_UNSUPP, VIRTIO_BLK_T_DISCARD,
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
    VIRTIO_BLK_T_WRITE_ZEROES, VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP,
};
use virtio_queue::desc::split::Descriptor;
use virtio_queue::DescriptorChain;
use vm_memory::{Address, GuestAddress, GuestMemory as _, Permissions, VolatileSlice};

use super::{ID_BYTES, MAX_DISCARD_SECTORS, MAX_DISCARD_SEGMENTS, QUEUE_SIZE, SECTOR_SIZE};
use crate::GuestMemory;

/// The size of `struct virtio_blk_outhdr` and of one discard / write-zeroes segment.
const HEADER_SIZE: u64 = 16;
const SEGMENT_SIZE: u64 = 16;
/// The longest chain looked at: a driver that does not use indirect descriptors cannot
/// make a longer one, and it bounds what one request allocates.
const MAX_DESCRIPTORS: usize = QUEUE_SIZE as usize;

/// The status byte's values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Status {
    Ok = VIRTIO_BLK_S_OK as u8,
    IoError = VIRTIO_BLK_S_IOERR as u8,
    Unsupported = VIRTIO_BLK_S_UNSUPP as u8,
}

/// What a request is checked against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub capacity_sectors: u64,
    pub read_only: bool,
}

/// A byte range of the disk a discard or write-zeroes segment covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub offset: u64,
    pub len: u64,
    /// WRITE_ZEROES may deallocate (VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP).
    pub unmap: bool,
}

/// Guest memory a request reads from or writes to, in order.
pub(crate) type GuestBuffers<'a> = Vec<VolatileSlice<'a>>;

pub(crate) enum Operation<'a> {
    /// Disk → guest, `len` bytes at byte `offset`.
    Read {
        offset: u64,
        len: u64,
        buffers: GuestBuffers<'a>,
    },
    /// Guest → disk.
    Write {
        offset: u64,
        len: u64,
        buffers: GuestBuffers<'a>,
    },
    Flush,
    /// The drive ID into `buffers` (at most 20 bytes of them).
    GetId {
        buffers: GuestBuffers<'a>,
    },
    Discard(Vec<Segment>),
    WriteZeroes(Vec<Segment>),
}

/// A checked request.
pub(crate) struct Request<'a> {
    pub head: u16,
    pub status_addr: GuestAddress,
    pub operation: Operation<'a>,
}

impl Request<'_> {
    /// The data bytes the rate limiter charges (reads and writes only).
    pub fn data_bytes(&self) -> u64 {
        match &self.operation {
            Operation::Read { len, .. } | Operation::Write { len, .. } => *len,
            _ => 0,
        }
    }
}

/// What came out of a chain.
pub(crate) enum Parsed<'a> {
    Request(Request<'a>),
    /// Answered with `status` without touching the disk.
    Refused {
        head: u16,
        status_addr: GuestAddress,
        status: Status,
        reason: String,
    },
    /// No status byte to answer in: the chain goes back with nothing written.
    Dropped {
        head: u16,
        reason: String,
    },
}

impl Parsed<'_> {
    /// The data bytes the rate limiter charges.
    pub fn data_bytes(&self) -> u64 {
        match self {
            Parsed::Request(request) => request.data_bytes(),
            _ => 0,
        }
    }
}

/// Parses and checks `chain`.
pub(crate) fn parse<'a>(
    chain: DescriptorChain<&'a GuestMemory>,
    memory: &'a GuestMemory,
    geometry: Geometry,
) -> Parsed<'a> {
    let head = chain.head_index();
    let dropped = |reason: &str| Parsed::Dropped {
        head,
        reason: reason.to_string(),
    };

    let mut descriptors: Vec<Descriptor> = Vec::new();
    for descriptor in chain.clone() {
        if descriptors.len() == MAX_DESCRIPTORS {
            return dropped("more than 256 descriptors");
        }
        descriptors.push(descriptor);
    }
    let Some(last) = descriptors.last() else {
        return dropped("empty descriptor chain");
    };
    if !last.is_write_only() || last.len() == 0 {
        return dropped("the last descriptor is not device-writable (no status byte)");
    }
    let Some(status_addr) = last.addr().checked_add(u64::from(last.len()) - 1) else {
        return dropped("the status byte's address overflows");
    };
    if !memory.check_range(status_addr, 1, Permissions::Write) {
        return dropped("the status byte is outside guest memory");
    }
    let refuse = |status: Status, reason: String| Parsed::Refused {
        head,
        status_addr,
        status,
        reason,
    };

    // Present: the last descriptor is writable.
    let first_writable = descriptors
        .iter()
        .position(|d| d.is_write_only())
        .unwrap_or(descriptors.len());
    let (readable, writable) = descriptors.split_at(first_writable);
    if writable.iter().any(|d| !d.is_write_only()) {
        return refuse(
            Status::IoError,
            "a device-readable descriptor follows a device-writable one".into(),
        );
    }
    let readable_len: u64 = readable.iter().map(|d| u64::from(d.len())).sum();
    let writable_len: u64 = writable.iter().map(|d| u64::from(d.len())).sum();

    let mut reader = match chain.reader(memory) {
        Ok(reader) => reader,
        Err(error) => {
            return refuse(
                Status::IoError,
                format!("a readable descriptor is outside guest memory: {error}"),
            )
        }
    };
    let mut header = [0u8; HEADER_SIZE as usize];
    if reader.read_exact(&mut header).is_err() {
        return refuse(
            Status::IoError,
            format!("the header is shorter than {HEADER_SIZE} bytes ({readable_len})"),
        );
    }
    let request_type = u32::from_le_bytes([header[0], header[1], header[2], header[3]]);
    let sector = u64::from_le_bytes([
        header[8], header[9], header[10], header[11], header[12], header[13], header[14],
        header[15],
    ]);

    let check_range = |len: u64| -> Result<u64, String> {
        if !len.is_multiple_of(SECTOR_SIZE) {
            return Err(format!(
                "{len} data bytes is not a multiple of {SECTOR_SIZE}"
            ));
        }
        let end = sector.checked_add(len / SECTOR_SIZE);
        match end {
            Some(end) if end <= geometry.capacity_sectors => Ok(sector * SECTOR_SIZE),
            _ => Err(format!(
                "sectors {sector}+{} are past the disk's {} sectors",
                len / SECTOR_SIZE,
                geometry.capacity_sectors
            )),
        }
    };

    let operation = match request_type {
        VIRTIO_BLK_T_IN => {
            let len = writable_len - 1;
            let offset = match check_range(len) {
                Ok(offset) => offset,
                Err(reason) => return refuse(Status::IoError, reason),
            };
            match guest_buffers(memory, writable, 0, len, Permissions::Write) {
                Ok(buffers) => Operation::Read {
                    offset,
                    len,
                    buffers,
                },
                Err(reason) => return refuse(Status::IoError, reason),
            }
        }
        VIRTIO_BLK_T_OUT => {
            if geometry.read_only {
                return refuse(Status::IoError, "write to a read-only drive".into());
            }
            let len = readable_len - HEADER_SIZE;
            let offset = match check_range(len) {
                Ok(offset) => offset,
                Err(reason) => return refuse(Status::IoError, reason),
            };
            match guest_buffers(memory, readable, HEADER_SIZE, len, Permissions::Read) {
                Ok(buffers) => Operation::Write {
                    offset,
                    len,
                    buffers,
                },
                Err(reason) => return refuse(Status::IoError, reason),
            }
        }
        VIRTIO_BLK_T_FLUSH => Operation::Flush,
        VIRTIO_BLK_T_GET_ID => {
            let len = (writable_len - 1).min(ID_BYTES as u64);
            match guest_buffers(memory, writable, 0, len, Permissions::Write) {
                Ok(buffers) => Operation::GetId { buffers },
                Err(reason) => return refuse(Status::IoError, reason),
            }
        }
        VIRTIO_BLK_T_DISCARD | VIRTIO_BLK_T_WRITE_ZEROES => {
            let write_zeroes = request_type == VIRTIO_BLK_T_WRITE_ZEROES;
            if geometry.read_only {
                return refuse(
                    Status::IoError,
                    "discard or write zeroes on a read-only drive".into(),
                );
            }
            let payload = readable_len - HEADER_SIZE;
            if payload == 0 || !payload.is_multiple_of(SEGMENT_SIZE) {
                return refuse(
                    Status::IoError,
                    format!("{payload} segment bytes is not a positive multiple of {SEGMENT_SIZE}"),
                );
            }
            let count = payload / SEGMENT_SIZE;
            if count > u64::from(MAX_DISCARD_SEGMENTS) {
                return refuse(
                    Status::IoError,
                    format!("{count} segments, the most is {MAX_DISCARD_SEGMENTS}"),
                );
            }
            let mut segments = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let mut raw = [0u8; SEGMENT_SIZE as usize];
                if reader.read_exact(&mut raw).is_err() {
                    return refuse(Status::IoError, "cannot read a segment".into());
                }
                match parse_segment(raw, write_zeroes, geometry) {
                    Ok(segment) => segments.push(segment),
                    Err((status, reason)) => return refuse(status, reason),
                }
            }
            if write_zeroes {
                Operation::WriteZeroes(segments)
            } else {
                Operation::Discard(segments)
            }
        }
        other => return refuse(Status::Unsupported, format!("request type {other}")),
    };
    Parsed::Request(Request {
        head,
        status_addr,
        operation,
    })
}

/// One `struct virtio_blk_discard_write_zeroes`, checked.
fn parse_segment(
    raw: [u8; SEGMENT_SIZE as usize],
    write_zeroes: bool,
    geometry: Geometry,
) -> Result<Segment, (Status, String)> {
    let sector = u64::from_le_bytes([
        raw[0], raw[1], raw[2], raw[3], raw[4], raw[5], raw[6], raw[7],
    ]);
    let num_sectors = u32::from_le_bytes([raw[8], raw[9], raw[10], raw[11]]);
    let flags = u32::from_le_bytes([raw[12], raw[13], raw[14], raw[15]]);
    let known_flags = if write_zeroes {
        VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP
    } else {
        0
    };
    if flags & !known_flags != 0 {
        return Err((Status::Unsupported, format!("segment flags {flags:#x}")));
    }
    if num_sectors > MAX_DISCARD_SECTORS {
        return Err((
            Status::IoError,
            format!("{num_sectors} sectors in a segment, the most is {MAX_DISCARD_SECTORS}"),
        ));
    }
    match sector.checked_add(u64::from(num_sectors)) {
        Some(end) if end <= geometry.capacity_sectors => Ok(Segment {
            offset: sector * SECTOR_SIZE,
            len: u64::from(num_sectors) * SECTOR_SIZE,
            unmap: flags & VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP != 0,
        }),
        _ => Err((
            Status::IoError,
            format!(
                "segment sectors {sector}+{num_sectors} are past the disk's {} sectors",
                geometry.capacity_sectors
            ),
        )),
    }
}

/// The guest memory of bytes `[skip, skip + len)` of `descriptors` taken end to end.
fn guest_buffers<'a>(
    memory: &'a GuestMemory,
    descriptors: &[Descriptor],
    skip: u64,
    len: u64,
    permissions: Permissions,
) -> Result<GuestBuffers<'a>, String> {
    let end = skip + len;
    let mut buffers = Vec::new();
    let mut position = 0u64;
    for descriptor in descriptors {
        let start = position;
        position += u64::from(descriptor.len());
        let (from, to) = (start.max(skip), position.min(end));
        if from < to {
            let addr = descriptor
                .addr()
                .checked_add(from - start)
                .ok_or("a buffer's address overflows")?;
            let outside =
                |error| format!("a buffer at {:#x} is outside guest memory: {error}", addr.0);
            for slice in memory
                .get_slices(addr, (to - from) as usize, permissions)
                .map_err(outside)?
            {
                buffers.push(slice.map_err(outside)?);
            }
        }
        if position >= end {
            break;
        }
    }
    Ok(buffers)
}

#[cfg(test)]
mod tests;
