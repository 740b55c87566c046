//! `virtio-fs`: the file-system device (type 26) served by virtiofsd, spoken to in FUSE
//! (include/uapi/linux/fuse.h, protocol 7.31 structures). It reads the tag and
//! num_request_queues from the device configuration, sets up the high-priority queue (0,
//! never used) and request queue 1, then on the request queue: FUSE_INIT, LOOKUP of
//! `hello.txt` in the root (node 1), OPEN, READ of its contents, RELEASE; then CREATE of
//! `from-guest.txt` (mode 0644, O_WRONLY|O_CREAT), WRITE of [`WRITTEN`], FLUSH, RELEASE,
//! and a LOOKUP that must show the new file's size.
//!
//! Each request is one chain: readable descriptors for fuse_in_header, the operation's
//! structure, the name (NUL-terminated) and the data, each in its own descriptor, then a
//! writable descriptor for fuse_out_header and, when the reply has a body, one for it.
//! A negative fuse_out_header.error, a reply whose length or unique does not match, or a
//! reply missing after [`super::REQUEST_TIMEOUT_MS`] fails the workload.
//!
//! Lines: `virtio-fs: tag=<tag> queues=<n>`, `virtio-fs: init ok major=7 minor=<m>`,
//! `virtio-fs: hello.txt <len> bytes: <up to 64 bytes, unprintable ones as '.'>`,
//! `virtio-fs: wrote from-guest.txt <n> bytes`, `virtio-fs: ok`.

use super::queue::{Buffer, SplitQueue};
use super::transport::VirtioPci;
use super::{read_ram, write_ram, Dma};
use crate::console::exit;
use crate::println;

const NAME: &str = "virtio-fs";
/// VIRTIO_ID_FS.
const TYPE_FS: u16 = 26;
/// struct virtio_fs_config: tag[36], then num_request_queues (le32).
const TAG_BYTES: u32 = 36;
const HIPRIO_QUEUE: u16 = 0;
const REQUEST_QUEUE: u16 = 1;

const FUSE_LOOKUP: u32 = 1;
const FUSE_OPEN: u32 = 14;
const FUSE_READ: u32 = 15;
const FUSE_WRITE: u32 = 16;
const FUSE_RELEASE: u32 = 18;
const FUSE_FLUSH: u32 = 25;
const FUSE_INIT: u32 = 26;
const FUSE_CREATE: u32 = 35;

const FUSE_KERNEL_VERSION: u32 = 7;
const FUSE_KERNEL_MINOR_VERSION: u32 = 31;
const ROOT_ID: u64 = 1;

const IN_HEADER_BYTES: usize = 40;
const OUT_HEADER_BYTES: usize = 16;
/// fuse_entry_out: nodeid, generation, entry_valid, attr_valid, two nsec fields (40
/// bytes), then fuse_attr (88 bytes).
const ENTRY_OUT_BYTES: usize = 128;
const ATTR_OFFSET: usize = 40;
const OPEN_OUT_BYTES: usize = 16;
/// fuse_init_out up to time_gran (FUSE_COMPAT_22_INIT_OUT_SIZE); newer servers send 64.
const INIT_OUT_MIN_BYTES: usize = 24;

const O_RDONLY: u32 = 0;
const O_WRONLY: u32 = 0o1;
const O_CREAT: u32 = 0o100;
const S_IFMT: u32 = 0o170000;
const S_IFREG: u32 = 0o100000;

const HELLO: &[u8] = b"hello.txt\0";
const CREATED: &[u8] = b"from-guest.txt\0";
/// What the workload writes into `from-guest.txt` (the host test checks these bytes).
const WRITTEN: &[u8] = b"written by the gpuvm test guest over virtio-fs\n";
/// How much of hello.txt is read (one READ).
const READ_BYTES: u32 = 4096;
/// The request buffer: the operation's structure, name and data, back to back.
const REQUEST_BYTES: u64 = 8192;
/// The reply body buffer.
const REPLY_BYTES: u64 = 8192;

/// The FUSE session on the request queue: one request at a time.
struct Fuse<'a> {
    dev: &'a VirtioPci,
    queue: SplitQueue,
    in_header: u64,
    request: u64,
    out_header: u64,
    reply: u64,
    unique: u64,
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(word)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

/// Little-endian fields appended to a fixed buffer (an operation's `*_in` structure).
struct Fields {
    bytes: [u8; 64],
    len: usize,
}

impl Fields {
    fn new() -> Fields {
        Fields {
            bytes: [0; 64],
            len: 0,
        }
    }

    fn u32(mut self, value: u32) -> Fields {
        self.bytes[self.len..self.len + 4].copy_from_slice(&value.to_le_bytes());
        self.len += 4;
        self
    }

    fn u64(mut self, value: u64) -> Fields {
        self.bytes[self.len..self.len + 8].copy_from_slice(&value.to_le_bytes());
        self.len += 8;
        self
    }

    fn as_slice(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

fn opcode_name(opcode: u32) -> &'static str {
    match opcode {
        FUSE_LOOKUP => "FUSE_LOOKUP",
        FUSE_OPEN => "FUSE_OPEN",
        FUSE_READ => "FUSE_READ",
        FUSE_WRITE => "FUSE_WRITE",
        FUSE_RELEASE => "FUSE_RELEASE",
        FUSE_FLUSH => "FUSE_FLUSH",
        FUSE_INIT => "FUSE_INIT",
        FUSE_CREATE => "FUSE_CREATE",
        _ => "FUSE_?",
    }
}

fn errno_name(errno: i32) -> &'static str {
    match errno {
        1 => "EPERM",
        2 => "ENOENT",
        5 => "EIO",
        9 => "EBADF",
        12 => "ENOMEM",
        13 => "EACCES",
        17 => "EEXIST",
        21 => "EISDIR",
        22 => "EINVAL",
        28 => "ENOSPC",
        30 => "EROFS",
        38 => "ENOSYS",
        71 => "EPROTO",
        _ => "?",
    }
}

impl<'a> Fuse<'a> {
    fn new(dev: &'a VirtioPci, queue: SplitQueue, dma: &mut Dma) -> Fuse<'a> {
        Fuse {
            dev,
            queue,
            in_header: dma.alloc(IN_HEADER_BYTES as u64, 64),
            request: dma.alloc(REQUEST_BYTES, 4096),
            out_header: dma.alloc(OUT_HEADER_BYTES as u64, 64),
            reply: dma.alloc(REPLY_BYTES, 4096),
            unique: 0,
        }
    }

    /// Sends `opcode` for `nodeid` with `parts` (each non-empty one its own readable
    /// descriptor) and room for `reply_len` bytes of reply body; returns how many body bytes
    /// came back. A negative error or a malformed reply fails the workload.
    fn call(&mut self, opcode: u32, nodeid: u64, parts: &[&[u8]], reply_len: u32) -> usize {
        let what = opcode_name(opcode);
        self.unique += 2;
        let unique = self.unique;
        let body: usize = parts.iter().map(|part| part.len()).sum();
        if body as u64 > REQUEST_BYTES || u64::from(reply_len) > REPLY_BYTES {
            self.dev
                .fail(format_args!("{what}: request of {body} bytes does not fit"));
        }
        let mut header = [0u8; IN_HEADER_BYTES];
        header[0..4].copy_from_slice(&((IN_HEADER_BYTES + body) as u32).to_le_bytes());
        header[4..8].copy_from_slice(&opcode.to_le_bytes());
        header[8..16].copy_from_slice(&unique.to_le_bytes());
        header[16..24].copy_from_slice(&nodeid.to_le_bytes());
        // uid 0, gid 0, pid 1, no extensions.
        header[32..36].copy_from_slice(&1u32.to_le_bytes());
        write_ram(self.in_header, &header);
        // A stale header must not pass for the device's answer.
        write_ram(self.out_header, &[0xff; OUT_HEADER_BYTES]);

        let mut buffers = [Buffer::readable(0, 0); 8];
        buffers[0] = Buffer::readable(self.in_header, IN_HEADER_BYTES as u32);
        let mut count = 1;
        let mut at = self.request;
        for part in parts.iter().filter(|part| !part.is_empty()) {
            write_ram(at, part);
            buffers[count] = Buffer::readable(at, part.len() as u32);
            count += 1;
            at += part.len() as u64;
        }
        buffers[count] = Buffer::writable(self.out_header, OUT_HEADER_BYTES as u32);
        count += 1;
        if reply_len > 0 {
            buffers[count] = Buffer::writable(self.reply, reply_len);
            count += 1;
        }
        if let Err(err) = self.queue.add(&buffers[..count], unique) {
            self.dev.fail(format_args!("{what}: request queue: {err}"));
        }
        self.queue.notify();
        let used = match self.queue.wait_used() {
            Ok(used) => used,
            Err(err) => self.dev.fail(format_args!("{what}: {err}")),
        };
        let mut out = [0u8; OUT_HEADER_BYTES];
        read_ram(self.out_header, &mut out);
        let len = u32_at(&out, 0);
        let error = u32_at(&out, 4) as i32;
        let echoed = u64_at(&out, 8);
        if used.token != unique || echoed != unique {
            self.dev.fail(format_args!(
                "{what}: reply for unique {echoed} (used token {}), expected {unique}",
                used.token
            ));
        }
        if error < 0 {
            self.dev.fail(format_args!(
                "{what}: error {error} ({})",
                errno_name(-error)
            ));
        }
        if error > 0 {
            self.dev.fail(format_args!(
                "{what}: error {error}, a positive error is not a FUSE reply"
            ));
        }
        let limit = OUT_HEADER_BYTES as u32 + reply_len;
        if len < OUT_HEADER_BYTES as u32 || len > limit || used.len != len {
            self.dev.fail(format_args!(
                "{what}: reply length {len} (used length {}), expected {OUT_HEADER_BYTES} to {limit}",
                used.len
            ));
        }
        len as usize - OUT_HEADER_BYTES
    }

    /// The reply body's first `N` bytes (`N` at most [`REPLY_BYTES`]).
    fn reply<const N: usize>(&self) -> [u8; N] {
        let mut bytes = [0u8; N];
        read_ram(self.reply, &mut bytes);
        bytes
    }

    /// Checks that a reply body is at least `needed` bytes long.
    fn expect_len(&self, opcode: u32, got: usize, needed: usize) {
        if got < needed {
            self.dev.fail(format_args!(
                "{}: reply body of {got} bytes, expected at least {needed}",
                opcode_name(opcode)
            ));
        }
    }

    /// LOOKUP `name` (NUL-terminated) in the root: (nodeid, size, mode).
    fn lookup(&mut self, name: &[u8]) -> (u64, u64, u32) {
        let got = self.call(FUSE_LOOKUP, ROOT_ID, &[name], ENTRY_OUT_BYTES as u32);
        self.expect_len(FUSE_LOOKUP, got, ENTRY_OUT_BYTES);
        let entry: [u8; ENTRY_OUT_BYTES] = self.reply();
        let nodeid = u64_at(&entry, 0);
        let size = u64_at(&entry, ATTR_OFFSET + 8);
        let mode = u32_at(&entry, ATTR_OFFSET + 60);
        self.check_entry(FUSE_LOOKUP, name, nodeid, mode);
        (nodeid, size, mode)
    }

    fn check_entry(&self, opcode: u32, name: &[u8], nodeid: u64, mode: u32) {
        let name = core::str::from_utf8(&name[..name.len() - 1]).unwrap_or("?");
        if nodeid == 0 || nodeid == ROOT_ID {
            self.dev.fail(format_args!(
                "{}: {name} has node id {nodeid}",
                opcode_name(opcode)
            ));
        }
        if mode & S_IFMT != S_IFREG {
            self.dev.fail(format_args!(
                "{}: {name} has mode {mode:#o}, not a regular file",
                opcode_name(opcode)
            ));
        }
    }

    /// OPEN `nodeid` with `flags`: the file handle.
    fn open(&mut self, nodeid: u64, flags: u32) -> u64 {
        let open_in = Fields::new().u32(flags).u32(0);
        let got = self.call(
            FUSE_OPEN,
            nodeid,
            &[open_in.as_slice()],
            OPEN_OUT_BYTES as u32,
        );
        self.expect_len(FUSE_OPEN, got, OPEN_OUT_BYTES);
        let open_out: [u8; OPEN_OUT_BYTES] = self.reply();
        u64_at(&open_out, 0)
    }

    /// RELEASE handle `fh` of `nodeid` (opened with `flags`).
    fn release(&mut self, nodeid: u64, fh: u64, flags: u32) {
        let release_in = Fields::new().u64(fh).u32(flags).u32(0).u64(0);
        self.call(FUSE_RELEASE, nodeid, &[release_in.as_slice()], 0);
    }
}

/// Reads virtio_fs_config: the tag (up to its first NUL) and num_request_queues.
fn read_fs_config(dev: &VirtioPci) -> ([u8; TAG_BYTES as usize], usize, u32) {
    dev.read_config(|dev| {
        let mut tag = [0u8; TAG_BYTES as usize];
        for (offset, byte) in tag.iter_mut().enumerate() {
            *byte = dev.config8(offset as u32);
        }
        let mut queues = [0u8; 4];
        for (offset, byte) in queues.iter_mut().enumerate() {
            *byte = dev.config8(TAG_BYTES + offset as u32);
        }
        let len = tag.iter().position(|&b| b == 0).unwrap_or(tag.len());
        (tag, len, u32::from_le_bytes(queues))
    })
}

/// `bytes` as text on one line: printable ASCII as is, anything else as '.'.
struct Printable<'b>(&'b [u8]);

impl core::fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
        use core::fmt::Write;
        self.0.iter().try_for_each(|&byte| {
            f.write_char(if byte == b' ' || byte.is_ascii_graphic() {
                byte as char
            } else {
                '.'
            })
        })
    }
}

pub fn run(dma: &mut Dma) -> ! {
    let mut dev = VirtioPci::find(NAME, TYPE_FS);
    dev.initialize(0);
    let (tag, tag_len, queues) = read_fs_config(&dev);
    let tag = match core::str::from_utf8(&tag[..tag_len]) {
        Ok(text) if !text.is_empty() && text.bytes().all(|b| b.is_ascii_graphic()) => text,
        _ => dev.fail(format_args!(
            "the tag is not printable ASCII: {}",
            super::Hex(&tag)
        )),
    };
    println!("{NAME}: tag={tag} queues={queues}");
    if queues == 0 {
        dev.fail(format_args!("num_request_queues is 0"));
    }
    let hiprio = dev.setup_queue(dma, HIPRIO_QUEUE, None);
    hiprio.suppress_interrupts(true);
    let queue = dev.setup_queue(dma, REQUEST_QUEUE, None);
    queue.suppress_interrupts(true);
    dev.driver_ok();
    let mut fuse = Fuse::new(&dev, queue, dma);

    // FUSE_INIT: fuse_init_in of 7.31 (major, minor, max_readahead, flags).
    let init_in = Fields::new()
        .u32(FUSE_KERNEL_VERSION)
        .u32(FUSE_KERNEL_MINOR_VERSION)
        .u32(0x2_0000)
        .u32(0);
    let got = fuse.call(FUSE_INIT, 0, &[init_in.as_slice()], 256);
    fuse.expect_len(FUSE_INIT, got, INIT_OUT_MIN_BYTES);
    let init_out: [u8; INIT_OUT_MIN_BYTES] = fuse.reply();
    let (major, minor) = (u32_at(&init_out, 0), u32_at(&init_out, 4));
    if major != FUSE_KERNEL_VERSION {
        dev.fail(format_args!(
            "FUSE_INIT: the server speaks {major}.{minor}, expected major {FUSE_KERNEL_VERSION}"
        ));
    }
    println!("{NAME}: init ok major={major} minor={minor}");

    // hello.txt: LOOKUP, OPEN, READ, RELEASE.
    let (hello, size, _) = fuse.lookup(HELLO);
    let fh = fuse.open(hello, O_RDONLY);
    let read_in = Fields::new()
        .u64(fh)
        .u64(0)
        .u32(READ_BYTES)
        .u32(0)
        .u64(0)
        .u32(O_RDONLY)
        .u32(0);
    let read = fuse.call(FUSE_READ, hello, &[read_in.as_slice()], READ_BYTES);
    let expected = size.min(u64::from(READ_BYTES)) as usize;
    if read != expected {
        dev.fail(format_args!(
            "FUSE_READ: {read} bytes of hello.txt, its size is {size}"
        ));
    }
    let contents: [u8; READ_BYTES as usize] = fuse.reply();
    println!(
        "{NAME}: hello.txt {read} bytes: {}",
        Printable(&contents[..read.min(64)])
    );
    fuse.release(hello, fh, O_RDONLY);

    // from-guest.txt: CREATE, WRITE, FLUSH, RELEASE, then LOOKUP for its size.
    let flags = O_WRONLY | O_CREAT;
    let create_in = Fields::new()
        .u32(flags)
        .u32(S_IFREG | 0o644)
        .u32(0o022)
        .u32(0);
    let got = fuse.call(
        FUSE_CREATE,
        ROOT_ID,
        &[create_in.as_slice(), CREATED],
        (ENTRY_OUT_BYTES + OPEN_OUT_BYTES) as u32,
    );
    fuse.expect_len(FUSE_CREATE, got, ENTRY_OUT_BYTES + OPEN_OUT_BYTES);
    let created: [u8; ENTRY_OUT_BYTES + OPEN_OUT_BYTES] = fuse.reply();
    let node = u64_at(&created, 0);
    fuse.check_entry(
        FUSE_CREATE,
        CREATED,
        node,
        u32_at(&created, ATTR_OFFSET + 60),
    );
    let fh = u64_at(&created, ENTRY_OUT_BYTES);
    let write_in = Fields::new()
        .u64(fh)
        .u64(0)
        .u32(WRITTEN.len() as u32)
        .u32(0)
        .u64(0)
        .u32(flags)
        .u32(0);
    let got = fuse.call(FUSE_WRITE, node, &[write_in.as_slice(), WRITTEN], 8);
    fuse.expect_len(FUSE_WRITE, got, 8);
    let write_out: [u8; 8] = fuse.reply();
    let written = u32_at(&write_out, 0) as usize;
    if written != WRITTEN.len() {
        dev.fail(format_args!(
            "FUSE_WRITE: {written} of {} bytes written",
            WRITTEN.len()
        ));
    }
    let flush_in = Fields::new().u64(fh).u32(0).u32(0).u64(0);
    fuse.call(FUSE_FLUSH, node, &[flush_in.as_slice()], 0);
    fuse.release(node, fh, flags);
    let (again, size, _) = fuse.lookup(CREATED);
    if again != node || size != WRITTEN.len() as u64 {
        dev.fail(format_args!(
            "FUSE_LOOKUP after the write: node {again} size {size}, expected node {node} size {}",
            WRITTEN.len()
        ));
    }
    println!("{NAME}: wrote from-guest.txt {written} bytes");
    println!("{NAME}: ok");
    exit(0)
}
