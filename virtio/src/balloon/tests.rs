use vm_memory::GuestAddress;

use super::*;
use crate::VirtioDevice;

/// Two RAM regions with a hole between them, as around the 32-bit MMIO window.
fn split_memory() -> GuestMemory {
    GuestMemory::from_ranges(&[
        (GuestAddress(0), 0x10_0000),
        (GuestAddress(0x20_0000), 0x10_0000),
    ])
    .unwrap()
}

#[test]
fn pfns_outside_guest_ram_are_refused() {
    let memory = split_memory();
    // First and last page of each region.
    for pfn in [0, 0xff, 0x200, 0x2ff] {
        assert!(pfn_is_ram(&memory, pfn), "pfn {pfn:#x}");
    }
    // The hole, just past the end, and the largest PFN a guest can name.
    for pfn in [0x100, 0x1ff, 0x300, u32::MAX] {
        assert!(!pfn_is_ram(&memory, pfn), "pfn {pfn:#x}");
    }
}

#[test]
fn contiguous_pfns_coalesce_into_runs_whatever_their_order() {
    let mut pfns = vec![7, 3, 4, 5, 9, 8, 4, 100];
    assert_eq!(
        coalesce(&mut pfns),
        [
            PageRun {
                first_pfn: 3,
                pages: 3
            },
            PageRun {
                first_pfn: 7,
                pages: 3
            },
            PageRun {
                first_pfn: 100,
                pages: 1
            },
        ]
    );
    assert_eq!(coalesce(&mut Vec::new()), []);
    let mut top = vec![u32::MAX, u32::MAX - 1];
    assert_eq!(
        coalesce(&mut top),
        [PageRun {
            first_pfn: u64::from(u32::MAX - 1),
            pages: 2
        }]
    );
}

#[test]
fn stats_buffers_must_be_whole_entries() {
    let mut bytes = Vec::new();
    for (tag, value) in [(4u16, 1000u64), (5, 2000), (200, 7)] {
        bytes.extend_from_slice(&tag.to_le_bytes());
        bytes.extend_from_slice(&value.to_le_bytes());
    }
    let stats = parse_stats(&bytes).unwrap();
    // Tag 200 is unknown and dropped.
    assert_eq!(stats, GuestStats::from([(4, 1000), (5, 2000)]));
    assert!(parse_stats(&bytes[..bytes.len() - 1]).is_err());
    assert!(parse_stats(&vec![0; (MAX_STAT_ENTRIES + 1) * STAT_ENTRY_SIZE]).is_err());
    assert_eq!(parse_stats(&[]).unwrap(), GuestStats::new());
}

#[test]
fn config_space_has_the_target_and_the_drivers_actual() {
    let mut balloon = Balloon::new(BalloonConfig {
        amount_mib: 2,
        deflate_on_oom: true,
        stats_polling_interval_s: 0,
    })
    .unwrap();
    assert_eq!(balloon.queue_max_sizes().len(), 2);
    assert_eq!(
        balloon.device_features(),
        1 << VIRTIO_BALLOON_F_DEFLATE_ON_OOM
    );
    let mut word = [0u8; 4];
    balloon.read_config(0, &mut word);
    assert_eq!(u32::from_le_bytes(word), 512);
    // num_pages is the host's: the driver's write is ignored.
    balloon.write_config(0, &7u32.to_le_bytes());
    balloon.write_config(4, &300u32.to_le_bytes());
    balloon.write_config(u64::MAX, &[1]);
    balloon.read_config(0, &mut word);
    assert_eq!(u32::from_le_bytes(word), 512);
    balloon.read_config(4, &mut word);
    assert_eq!(u32::from_le_bytes(word), 300);
    balloon.set_target_mib(1);
    let report = balloon.report();
    assert_eq!((report.target_pages, report.actual_pages), (256, 300));
    // Statistics were off when it was built: they stay off.
    assert!(balloon.set_stats_interval(1).is_err());
    assert!(balloon.set_stats_interval(0).is_ok());
}

#[test]
fn state_round_trips_and_refuses_a_different_stats_setting() {
    let config = BalloonConfig {
        amount_mib: 4,
        deflate_on_oom: false,
        stats_polling_interval_s: 2,
    };
    let mut balloon = Balloon::new(config.clone()).unwrap();
    assert_eq!(balloon.queue_max_sizes().len(), 3);
    balloon.write_config(4, &1024u32.to_le_bytes());
    balloon.set_target_mib(8);
    let state = balloon.save_state().unwrap();
    let mut restored = Balloon::new(config).unwrap();
    restored.restore_state(&state).unwrap();
    assert_eq!(restored.report(), balloon.report());
    assert_eq!(restored.config().amount_mib, 8);
    let mut without_stats = Balloon::new(BalloonConfig::default()).unwrap();
    let error = without_stats.restore_state(&state).unwrap_err().to_string();
    assert!(error.contains("statistics on"), "{error}");
    let error = restored
        .restore_state(&crate::DeviceState::Vsock(crate::vsock::VsockState {
            guest_cid: 3,
        }))
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("a vsock state, this is a balloon device"),
        "{error}"
    );
}

/// The statistics survive the state file's flattened device list (serde buffers it, and a
/// buffered map key is text): the state reads back from JSON with a number-tagged map.
#[test]
fn state_with_statistics_reads_back_through_a_flattened_struct() {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Outer {
        #[serde(flatten)]
        inner: Inner,
    }
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Inner {
        balloon: super::BalloonState,
    }
    let state = super::BalloonState {
        target_pages: 2048,
        actual_pages: 1024,
        stats_polling_interval_s: 1,
        stats: Some([(4u16, 1u64 << 30), (5, 123)].into_iter().collect()),
        held_stats_head: Some(3),
        counters: Default::default(),
    };
    let json = serde_json::to_string(&Outer {
        inner: Inner {
            balloon: state.clone(),
        },
    })
    .unwrap();
    let back: Outer = serde_json::from_str(&json).unwrap();
    assert_eq!(back.inner.balloon, state);
    let forged = json.replace("\"4\"", "\"four\"");
    let error = serde_json::from_str::<Outer>(&forged)
        .err()
        .unwrap()
        .to_string();
    assert!(error.contains("\"four\" is not a number"), "{error}");
}
