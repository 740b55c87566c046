//! Handing a vfio-user connection from one gpuvm process to another (live update) without
//! the device process noticing: no new connection, no version negotiation, no reset, no
//! DMA re-map.
//!
//! The old process sends the connection's socket (SCM_RIGHTS, a duplicate) and what its
//! client learnt when it connected: the region layout ([`ConnectionLayout`]) and the files
//! the device shares for its mmappable regions. The `vfio_user` crate's client owns its
//! socket and has no constructor over an open one: it always connects to a path and
//! negotiates. So the new process lets a client connect to a short-lived server of its own
//! ([`vfio_user::Server`] on a socket in a private directory) that answers the negotiation
//! and the region queries from the handed-over layout, then puts the handed-over
//! connection in place of that client's socket (dup3 onto the client's descriptor number).
//! From then on the client speaks to the device on the connection the old process used;
//! the device saw nothing.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vfio_bindings::bindings::vfio::{
    vfio_region_info, vfio_region_sparse_mmap_area, VFIO_REGION_INFO_FLAG_CAPS,
};
use vfio_user::{
    Client, DmaMapFlags, DmaUnmapFlags, Server, ServerBackend, ServerRegion, SparseArea,
};

use crate::{Result, VfioError};

/// One region as the client knows it (`vfio_user::Region`), its file aside.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RegionLayout {
    pub index: u32,
    pub flags: u32,
    pub size: u64,
    /// Where the region starts in the file the device shares for it, when it has one (the
    /// file travels as a descriptor, in region order).
    pub file_start: Option<u64>,
    /// The mmappable areas (offset, size).
    pub sparse_areas: Vec<(u64, u64)>,
}

/// What the client learnt of its device when it connected, which the device is not asked
/// again after a hand-over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectionLayout {
    /// `Client::resettable()` as the crate reports it (inverted: see user.rs's reset).
    pub client_resettable: bool,
    pub regions: Vec<RegionLayout>,
}

impl ConnectionLayout {
    /// How many region files come with the layout.
    pub fn file_count(&self) -> usize {
        self.regions
            .iter()
            .filter(|r| r.file_start.is_some())
            .count()
    }
}

/// The layout of `client`'s regions and duplicates of their files, in region order.
pub(crate) fn layout_of(client: &Client) -> Result<(ConnectionLayout, Vec<OwnedFd>)> {
    let mut regions = Vec::new();
    let mut files = Vec::new();
    let mut index = 0;
    while let Some(region) = client.region(index) {
        let file_start = match &region.file_offset {
            Some(file) => {
                files.push(file.file().try_clone().map(OwnedFd::from)?);
                Some(file.start())
            }
            None => None,
        };
        regions.push(RegionLayout {
            index: region.index,
            flags: region.flags,
            size: region.size,
            file_start,
            sparse_areas: region
                .sparse_areas
                .iter()
                .map(|area| (area.offset, area.size))
                .collect(),
        });
        index += 1;
    }
    Ok((
        ConnectionLayout {
            client_resettable: client.resettable(),
            regions,
        },
        files,
    ))
}

/// Answers nothing but the negotiation and the region queries, which [`Server`] handles
/// itself: any device request reaching it is refused.
struct LayoutOnly;

fn refused() -> std::io::Error {
    std::io::Error::other("the layout server takes no device requests")
}

impl ServerBackend for LayoutOnly {
    fn region_read(&mut self, _: u32, _: u64, _: &mut [u8]) -> std::io::Result<()> {
        Err(refused())
    }
    fn region_write(&mut self, _: u32, _: u64, _: &[u8]) -> std::io::Result<()> {
        Err(refused())
    }
    fn dma_map(
        &mut self,
        _: DmaMapFlags,
        _: u64,
        _: u64,
        _: u64,
        _: Option<File>,
    ) -> std::io::Result<()> {
        Err(refused())
    }
    fn dma_unmap(&mut self, _: DmaUnmapFlags, _: u64, _: u64) -> std::io::Result<()> {
        Err(refused())
    }
    fn reset(&mut self) -> std::io::Result<()> {
        Err(refused())
    }
    fn set_irqs(&mut self, _: u32, _: u32, _: u32, _: u32, _: Vec<File>) -> std::io::Result<()> {
        Err(refused())
    }
}

/// A private directory (mode 0700) removed with what is in it when dropped.
struct PrivateDir(PathBuf);

impl PrivateDir {
    /// A new directory, its name never used before by this process: a layout server of
    /// an earlier take-over may still be ending, and removes its socket's path as it ends
    /// (which must not be a later server's).
    fn create() -> std::io::Result<PrivateDir> {
        use std::os::unix::fs::DirBuilderExt;
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let base = std::env::temp_dir();
        for _ in 0..16 {
            let path = base.join(format!(
                "gpuvm-vfio-user-adopt-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(PrivateDir(path)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "no free name for the layout server's directory",
        ))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The server side of `layout`: each region as the device described it, its file (from
/// `files`, in region order) sent with it.
fn server_regions(layout: &ConnectionLayout, files: &[OwnedFd]) -> Result<Vec<ServerRegion>> {
    let mut files = files.iter();
    let mut regions = Vec::new();
    for (position, region) in layout.regions.iter().enumerate() {
        if region.index as usize != position {
            return Err(adopt_error(format!(
                "region {position} of the layout says index {}",
                region.index
            )));
        }
        // The crate's server sends a region's file only with its sparse-mmap capability;
        // a file without areas could not be given back as the client had it.
        if region.file_start.is_some() && region.sparse_areas.is_empty() {
            return Err(adopt_error(format!(
                "region {} has a file but no mmappable areas",
                region.index
            )));
        }
        let mmap_fd = match region.file_start {
            Some(_) => Some(
                files
                    .next()
                    .ok_or_else(|| adopt_error("fewer region files than the layout names".into()))?
                    .as_raw_fd(),
            ),
            None => None,
        };
        regions.push(ServerRegion {
            region_info: vfio_region_info {
                argsz: std::mem::size_of::<vfio_region_info>() as u32,
                // The server sets the capability flag itself when there are areas.
                flags: region.flags & !VFIO_REGION_INFO_FLAG_CAPS,
                index: region.index,
                cap_offset: 0,
                size: region.size,
                offset: region.file_start.unwrap_or(0),
            },
            sparse_areas: region
                .sparse_areas
                .iter()
                .map(|&(offset, size)| SparseArea {
                    area: vfio_region_sparse_mmap_area { offset, size },
                })
                .collect(),
            mmap_fd,
        });
    }
    if files.next().is_some() {
        return Err(adopt_error(
            "more region files than the layout names".into(),
        ));
    }
    Ok(regions)
}

fn adopt_error(reason: String) -> VfioError {
    VfioError::Io(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("cannot take over the vfio-user connection: {reason}"),
    ))
}

/// A client over `connection` (an open, negotiated vfio-user connection handed over by
/// another process) that knows the device as `layout` and `files` describe it. Nothing is
/// sent on `connection`. `timeout` bounds the local exchange. `connect` makes a client the
/// usual way (negotiated, regions read) and says which descriptor holds its socket: the
/// client side's own connect (crate::user), given here so that this module needs nothing
/// of it.
pub(crate) fn adopt_client(
    connection: &OwnedFd,
    layout: &ConnectionLayout,
    files: &[OwnedFd],
    timeout: Duration,
    connect: impl FnOnce(&Path, Duration) -> Result<(Client, RawFd)>,
) -> Result<Client> {
    let regions = server_regions(layout, files)?;
    let dir = PrivateDir::create()?;
    let path = dir.0.join("layout.sock");
    // The server's flag is the client's inverted (vfio_user 0.1.7).
    let server =
        Server::new(&path, !layout.client_resettable, Vec::new(), regions).map_err(|source| {
            VfioError::Connect {
                path: path.clone(),
                source,
            }
        })?;
    // The server ends by itself once its one connection closes: after the dup3 below, or
    // when a failed connect drops it. Never waited for, so nothing here can hang on it.
    std::thread::Builder::new()
        .name("vfio-user-adopt".into())
        .spawn(move || {
            if let Err(error) = server.run(&mut LayoutOnly) {
                log::debug!("vfio-user: layout server: {error}");
            }
        })?;
    let (client, client_fd) = connect(&path, timeout).inspect_err(|_| {
        // A server still waiting to accept ends on a connection that closes at once.
        drop(std::os::unix::net::UnixStream::connect(&path));
    })?;
    // SAFETY: dup3 onto the client's own descriptor (`client_fd`, open while `client`
    // is): it atomically becomes the handed-over connection, and the local connection's
    // last descriptor closes, which ends the server.
    if unsafe { libc::dup3(connection.as_raw_fd(), client_fd, libc::O_CLOEXEC) } < 0 {
        return Err(adopt_error(format!(
            "dup3: {}",
            std::io::Error::last_os_error()
        )));
    }
    Ok(client)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::user::{BackendHealth, VfioUserDevice};
    use crate::PassthroughDevice;

    /// BAR0's first scratch register on the emulated GPU.
    const SCRATCH: u64 = 0x100;

    fn read_scratch(device: &mut VfioUserDevice) -> u32 {
        let mut bytes = [0u8; 4];
        device.region_read(0, SCRATCH, &mut bytes).expect("read");
        u32::from_le_bytes(bytes)
    }

    /// A second client takes the first one's connection over: the device (the emulated
    /// GPU, which serves one connection and keeps its registers until a reset) answers it
    /// with what the first wrote, the layout is the same, and the first, released, no
    /// longer speaks on the connection nor closes it.
    #[test]
    fn a_connection_is_taken_over_without_the_device_seeing_a_new_one() {
        let path = std::env::temp_dir().join(format!(
            "gpuvm-vfio-user-adopt-test-{}.sock",
            std::process::id()
        ));
        let _ = std::fs::remove_file(&path);
        let serving = {
            let path = path.clone();
            std::thread::spawn(move || crate::emu::serve(&path, Default::default()))
        };
        let timeout = Duration::from_secs(5);
        let deadline = std::time::Instant::now() + timeout;
        let mut first = loop {
            match VfioUserDevice::connect_within(&path, timeout) {
                Ok(device) => break device,
                Err(error) if std::time::Instant::now() < deadline => {
                    log::debug!("not listening yet: {error}");
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(error) => panic!("cannot connect: {error}"),
            }
        };
        first
            .region_write(0, SCRATCH, &0x5ca1_ab1eu32.to_le_bytes())
            .expect("write");
        let connection = first.connection();
        let (layout, socket, files) = connection.hand_over().expect("hand over");
        assert_eq!(files.len(), layout.file_count());
        assert!(layout.file_count() > 0, "{layout:?}");
        connection.release("the test's second client");
        // Released: the first neither reads from the device, nor resets it (as its PCI
        // model does when dropped), nor shuts the connection down.
        assert_eq!(read_scratch(&mut first), u32::MAX);
        first.reset().expect("a released device's reset is a no-op");
        let first_bar1 = first.region_info(1).expect("BAR1");
        drop(first);

        let mut second = VfioUserDevice::adopt(
            &path,
            socket,
            &layout,
            &files,
            timeout,
            Arc::new(BackendHealth::default()),
        )
        .expect("adopt");
        assert_eq!(read_scratch(&mut second), 0x5ca1_ab1e);
        let second_bar1 = second.region_info(1).expect("BAR1");
        assert_eq!(
            (second_bar1.size, second_bar1.flags, second_bar1.mmap_areas),
            (first_bar1.size, first_bar1.flags, first_bar1.mmap_areas)
        );
        assert!(second.region_file(1).is_some(), "BAR1's file");
        // The device served one connection: it ends when the second client closes it.
        drop(second);
        serving.join().expect("server thread").expect("served");
        let _ = std::fs::remove_file(&path);
    }
}
