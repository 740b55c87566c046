//! Parsing chains the way a driver (or a hostile guest) lays them out.

use super::*;
use virtio_bindings::virtio_ring::{VRING_DESC_F_NEXT, VRING_DESC_F_WRITE};
use virtio_queue::desc::RawDescriptor;
use virtio_queue::mock::MockSplitQueue;
use virtio_queue::{Queue, QueueOwnedT};
use vm_memory::Bytes;

const GEOMETRY: Geometry = Geometry {
    capacity_sectors: 16,
    read_only: false,
};

fn memory() -> GuestMemory {
    crate::test_util::memory(0x20_0000)
}

/// Runs `parse` on a chain of (address, length, writable) descriptors.
fn parse_chain<R>(
    memory: &GuestMemory,
    descriptors: &[(u64, u32, bool)],
    geometry: Geometry,
    check: impl FnOnce(Parsed) -> R,
) -> R {
    let mock = MockSplitQueue::create(memory, GuestAddress(0), 16);
    let raw: Vec<RawDescriptor> = descriptors
        .iter()
        .enumerate()
        .map(|(i, &(addr, len, writable))| {
            let mut flags = if writable { VRING_DESC_F_WRITE } else { 0 };
            if i + 1 < descriptors.len() {
                flags |= VRING_DESC_F_NEXT;
            }
            RawDescriptor::from(Descriptor::new(addr, len, flags as u16, i as u16 + 1))
        })
        .collect();
    mock.add_desc_chains(&raw, 0).unwrap();
    let mut queue: Queue = mock.create_queue().unwrap();
    let chain = queue.iter(memory).unwrap().next().unwrap();
    check(parse(chain, memory, geometry))
}

fn header(memory: &GuestMemory, request_type: u32, sector: u64) {
    memory
        .write_obj(request_type.to_le(), GuestAddress(0x1_0000))
        .unwrap();
    memory.write_obj(0u32, GuestAddress(0x1_0004)).unwrap();
    memory
        .write_obj(sector.to_le(), GuestAddress(0x1_0008))
        .unwrap();
}

fn refused_status(parsed: Parsed) -> Status {
    match parsed {
        Parsed::Refused { status, .. } => status,
        Parsed::Request(_) => panic!("accepted"),
        Parsed::Dropped { reason, .. } => panic!("dropped: {reason}"),
    }
}

#[test]
fn a_read_with_a_split_header_and_data_sharing_the_status_descriptor() {
    let memory = memory();
    header(&memory, VIRTIO_BLK_T_IN, 3);
    let chain = [
        (0x1_0000, 10, false),
        (0x1_000a, 6, false),
        (0x2_0000, 512, true),
        (0x3_0000, 513, true),
    ];
    parse_chain(&memory, &chain, GEOMETRY, |parsed| {
        let Parsed::Request(request) = parsed else {
            panic!("refused")
        };
        assert_eq!(request.status_addr, GuestAddress(0x3_0000 + 512));
        let Operation::Read {
            offset,
            len,
            buffers,
        } = request.operation
        else {
            panic!("not a read")
        };
        assert_eq!((offset, len), (3 * 512, 1024));
        let lengths: Vec<usize> = buffers.iter().map(|b| b.len()).collect();
        assert_eq!(lengths, [512, 512]);
    });
}

#[test]
fn chains_without_a_status_byte_are_dropped() {
    let memory = memory();
    header(&memory, VIRTIO_BLK_T_IN, 0);
    for chain in [
        &[(0x1_0000, 16, false)][..],
        &[(0x1_0000, 16, false), (0x2_0000, 0, true)][..],
        &[(0x1_0000, 16, false), (0x10_0000_0000, 1, true)][..],
    ] {
        parse_chain(&memory, chain, GEOMETRY, |parsed| {
            assert!(matches!(parsed, Parsed::Dropped { .. }), "{chain:?}");
        });
    }
}

#[test]
fn bad_requests_get_an_error_status() {
    let memory = memory();
    let status = (0x4_0000, 1, true);
    type Case<'c> = (u32, u64, &'c [(u64, u32, bool)], Status);
    let cases: &[Case] = &[
        // Past the end, and overflowing the sector arithmetic.
        (
            VIRTIO_BLK_T_IN,
            16,
            &[(0x1_0000, 16, false), (0x2_0000, 512, true), status],
            Status::IoError,
        ),
        (
            VIRTIO_BLK_T_IN,
            u64::MAX,
            &[(0x1_0000, 16, false), (0x2_0000, 512, true), status],
            Status::IoError,
        ),
        // Not whole sectors.
        (
            VIRTIO_BLK_T_OUT,
            0,
            &[(0x1_0000, 16, false), (0x2_0000, 100, false), status],
            Status::IoError,
        ),
        // Readable after writable.
        (
            VIRTIO_BLK_T_IN,
            0,
            &[
                (0x1_0000, 16, false),
                (0x2_0000, 512, true),
                (0x5_0000, 1, false),
                status,
            ],
            Status::IoError,
        ),
        // Data outside guest memory.
        (
            VIRTIO_BLK_T_IN,
            0,
            &[(0x1_0000, 16, false), (0x1f_ff00, 512, true), status],
            Status::IoError,
        ),
        // Short header.
        (
            VIRTIO_BLK_T_IN,
            0,
            &[(0x1_0000, 8, false), status],
            Status::IoError,
        ),
        (77, 0, &[(0x1_0000, 16, false), status], Status::Unsupported),
    ];
    for &(request_type, sector, chain, expected) in cases {
        header(&memory, request_type, sector);
        let got = parse_chain(&memory, chain, GEOMETRY, refused_status);
        assert_eq!(
            got, expected,
            "type {request_type} sector {sector} {chain:?}"
        );
    }
}

#[test]
fn segments_are_bounded_and_checked() {
    let memory = memory();
    let segment = |sector: u64, sectors: u32, flags: u32| {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&sector.to_le_bytes());
        raw[8..12].copy_from_slice(&sectors.to_le_bytes());
        raw[12..].copy_from_slice(&flags.to_le_bytes());
        raw
    };
    let status = (0x4_0000, 1, true);
    let cases = [
        (VIRTIO_BLK_T_DISCARD, segment(2, 4, 0), None),
        (
            VIRTIO_BLK_T_DISCARD,
            segment(2, 4, 1),
            Some(Status::Unsupported),
        ),
        (VIRTIO_BLK_T_WRITE_ZEROES, segment(2, 4, 1), None),
        (
            VIRTIO_BLK_T_WRITE_ZEROES,
            segment(2, 4, 2),
            Some(Status::Unsupported),
        ),
        (
            VIRTIO_BLK_T_DISCARD,
            segment(14, 4, 0),
            Some(Status::IoError),
        ),
        (
            VIRTIO_BLK_T_DISCARD,
            segment(u64::MAX, 4, 0),
            Some(Status::IoError),
        ),
    ];
    for (request_type, raw, expected) in cases {
        header(&memory, request_type, 0);
        memory.write_slice(&raw, GuestAddress(0x2_0000)).unwrap();
        let chain = [(0x1_0000, 16, false), (0x2_0000, 16, false), status];
        parse_chain(&memory, &chain, GEOMETRY, |parsed| {
            match (parsed, expected) {
                (Parsed::Request(request), None) => match request.operation {
                    Operation::Discard(segments) | Operation::WriteZeroes(segments) => {
                        assert_eq!(segments[0].offset, 1024);
                        assert_eq!(segments[0].len, 2048);
                        assert_eq!(segments[0].unmap, request_type == VIRTIO_BLK_T_WRITE_ZEROES);
                    }
                    _ => panic!("wrong operation"),
                },
                (parsed, Some(expected)) => assert_eq!(refused_status(parsed), expected),
                (_, None) => panic!("refused {raw:?}"),
            }
        });
    }
    // More segments than advertised.
    header(&memory, VIRTIO_BLK_T_DISCARD, 0);
    let many = (MAX_DISCARD_SEGMENTS + 1) * 16;
    let chain = [(0x1_0000, 16, false), (0x2_0000, many, false), status];
    assert_eq!(
        parse_chain(&memory, &chain, GEOMETRY, refused_status),
        Status::IoError
    );
    // Read-only drives refuse writes of every kind.
    let read_only = Geometry {
        read_only: true,
        ..GEOMETRY
    };
    for request_type in [
        VIRTIO_BLK_T_OUT,
        VIRTIO_BLK_T_DISCARD,
        VIRTIO_BLK_T_WRITE_ZEROES,
    ] {
        header(&memory, request_type, 0);
        let chain = [(0x1_0000, 16, false), (0x2_0000, 512, false), status];
        assert_eq!(
            parse_chain(&memory, &chain, read_only, refused_status),
            Status::IoError
        );
    }
}
