use super::*;

fn controller() -> ApiController {
    let (_, requests) = std::sync::mpsc::channel();
    let config = VmConfig {
        machine: MachineConfig::default(),
        boot: default_boot_source(),
    };
    let event = EventFd::new(0).unwrap();
    ApiController::new(
        requests,
        event,
        config,
        Box::new(|| Box::new(std::io::sink())),
    )
}

/// Tap descriptors (Cloud Hypervisor's vm.add-net): one per queue pair, each a tap;
/// anything else is refused at once and nothing is configured.
#[test]
fn passed_tap_descriptors_are_counted_and_checked() {
    let mut controller = controller();
    let net = gpuvm_virtio::net::NetConfig::new("net0", None);
    let (reader, writer) = std::io::pipe().unwrap();
    let fds = vec![reader.into(), writer.into()];
    let action = VmmAction::PutNetworkInterfaceFds {
        config: net.clone(),
        fds,
    };
    let error = controller.pre_boot(action).0.unwrap_err();
    assert_eq!(error.status, 400);
    assert!(error.message.contains("1 queue pair"), "{}", error.message);

    let (reader, _writer) = std::io::pipe().unwrap();
    let action = VmmAction::PutNetworkInterfaceFds {
        config: net,
        fds: vec![reader.into()],
    };
    let error = controller.pre_boot(action).0.unwrap_err();
    assert_eq!(error.status, 400);
    assert!(
        error.message.contains("net0") && error.message.contains("TUNGETIFF"),
        "{}",
        error.message
    );
    assert!(controller.pci.virtio.nets.is_empty());
    assert!(controller.pci.passed_taps.ids().is_empty());
}
