//! `virtio-balloon [hostile] [TOUCH_MIB]`: the memory balloon's driver (device type 5). Negotiates the
//! statistics queue when offered, then polls the configuration: inflates to the host's
//! `num_pages` by handing over page frame numbers from the top of RAM (each page filled
//! with a pattern first, so the host really holds it), deflates when the target goes down
//! and checks the deflated pages read as zero (the host freed them) before reusing them,
//! writes `actual` after each step and keeps a statistics buffer in the stats queue.
//! `hostile` first sends what a device must refuse: PFNs past RAM, a huge inflate buffer, a
//! buffer that is not whole PFNs and a statistics buffer of the wrong size. `TOUCH_MIB`
//! fills that much of the balloon's pages first, so the host holds them before they are
//! given back.

use super::queue::{Buffer, SplitQueue};
use super::transport::{VirtioPci, NO_VECTOR};
use super::{write_ram, Deadline, Dma};
use crate::bootinfo::{BootInfo, E820_RAM};
use crate::println;

const NAME: &str = "virtio-balloon";
pub const TYPE_BALLOON: u16 = 5;
const F_STATS_VQ: u64 = 1 << 1;
const PAGE: u64 = 4096;
/// PFNs per inflate or deflate buffer (as Linux).
const PFNS_PER_BUFFER: u32 = 256;
/// Pages below this are the kernel's, the rings' and the DMA area's: never ballooned.
const LOWEST_BALLOON_ADDR: u64 = super::DMA_END;
const CONFIG_NUM_PAGES: u32 = 0;
const CONFIG_ACTUAL: u32 = 4;
const STAT_FREE_MEMORY: u16 = 4;
const STAT_TOTAL_MEMORY: u16 = 5;
const STAT_AVAILABLE_MEMORY: u16 = 6;
const PATTERN_SEED: u64 = 0xba11_0017;

/// The pages the balloon may take: downwards from the top of the highest RAM range.
struct Pages {
    top: u64,
    count: u32,
}

impl Pages {
    fn find(info: &BootInfo) -> Pages {
        let top = info
            .memmap()
            .iter()
            .filter(|e| e.kind == E820_RAM)
            .map(|e| e.addr.saturating_add(e.size) & !(PAGE - 1))
            .filter(|&end| end <= crate::boot::MAPPED_LIMIT)
            .max()
            .unwrap_or(0);
        let bottom = info
            .memmap()
            .iter()
            .filter(|e| e.kind == E820_RAM && e.addr.saturating_add(e.size) & !(PAGE - 1) == top)
            .map(|e| e.addr.max(LOWEST_BALLOON_ADDR))
            .next()
            .unwrap_or(top);
        let count = (top.saturating_sub(bottom) / PAGE).min(u64::from(u32::MAX)) as u32;
        Pages { top, count }
    }

    /// The address of the balloon's `index`-th page (0 is the highest).
    fn addr(&self, index: u32) -> u64 {
        self.top - (u64::from(index) + 1) * PAGE
    }
}

struct Driver {
    dev: VirtioPci,
    inflate: SplitQueue,
    deflate: SplitQueue,
    stats: Option<SplitQueue>,
    /// One page for a PFN array, one for the statistics buffer.
    pfn_buffer: u64,
    stats_buffer: u64,
    pages: Pages,
    /// Pages in the balloon now (the lowest-indexed ones).
    held: u32,
    stats_sent: u64,
}

impl Driver {
    fn target(&self) -> u32 {
        self.dev.read_config(|d| d.config32(CONFIG_NUM_PAGES))
    }

    fn send(&mut self, inflate: bool, first: u32, count: u32) {
        let mut bytes = [0u8; 4 * PFNS_PER_BUFFER as usize];
        for i in 0..count {
            let pfn = (self.pages.addr(first + i) / PAGE) as u32;
            bytes[4 * i as usize..4 * i as usize + 4].copy_from_slice(&pfn.to_le_bytes());
        }
        write_ram(self.pfn_buffer, &bytes[..4 * count as usize]);
        self.submit(inflate, self.pfn_buffer, 4 * count);
    }

    /// Hands one readable buffer to the inflate or deflate queue and waits for it.
    fn submit(&mut self, inflate: bool, addr: u64, len: u32) {
        let queue = if inflate {
            &mut self.inflate
        } else {
            &mut self.deflate
        };
        let which = if inflate { "inflate" } else { "deflate" };
        if let Err(err) = queue.add(&[Buffer::readable(addr, len)], 0) {
            self.dev.fail(format_args!("{which} queue: {err}"));
        }
        queue.notify();
        if let Err(err) = queue.wait_used() {
            self.dev.fail(format_args!("{which} queue: {err}"));
        }
    }

    fn report_actual(&self) {
        self.dev.write_config32(CONFIG_ACTUAL, self.held);
        println!("{NAME}: actual {} pages", self.held);
    }

    fn inflate_by(&mut self, count: u32) {
        for i in self.held..self.held + count {
            crate::pattern::fill(self.pages.addr(i), PAGE, PATTERN_SEED);
        }
        self.send(true, self.held, count);
        self.held += count;
    }

    fn deflate_by(&mut self, count: u32) {
        let first = self.held - count;
        self.send(false, first, count);
        for i in first..self.held {
            let addr = self.pages.addr(i);
            // SAFETY: `addr` is a whole page of RAM below MAPPED_LIMIT (identity mapped,
            // user accessible) that the balloon owned and just gave back to this driver.
            let words = unsafe { core::slice::from_raw_parts(addr as *const u64, 512) };
            if let Some(word) = words.iter().position(|&w| w != 0) {
                self.dev.fail(format_args!(
                    "deflated page {addr:#x} reads {:#x} at word {word}: the host did not free it",
                    words[word]
                ));
            }
            // Reused: the page is ours again.
            crate::pattern::fill(addr, PAGE, PATTERN_SEED ^ 1);
        }
        self.held = first;
    }

    /// Fills the statistics buffer and hands it to the device.
    fn send_stats(&mut self) {
        let Some(queue) = self.stats.as_mut() else {
            return;
        };
        let total = u64::from(self.pages.count) * PAGE;
        let free = total - u64::from(self.held) * PAGE;
        let mut bytes = [0u8; 30];
        for (i, (tag, value)) in [
            (STAT_TOTAL_MEMORY, total),
            (STAT_FREE_MEMORY, free),
            (STAT_AVAILABLE_MEMORY, free),
        ]
        .into_iter()
        .enumerate()
        {
            bytes[10 * i..10 * i + 2].copy_from_slice(&tag.to_le_bytes());
            bytes[10 * i + 2..10 * i + 10].copy_from_slice(&value.to_le_bytes());
        }
        write_ram(self.stats_buffer, &bytes);
        if let Err(err) = queue.add(&[Buffer::readable(self.stats_buffer, 30)], 0) {
            self.dev.fail(format_args!("stats queue: {err}"));
        }
        queue.notify();
        self.stats_sent += 1;
        println!("{NAME}: stats sent {}", self.stats_sent);
    }

    /// The device gave the statistics buffer back: it wants new statistics.
    fn poll_stats(&mut self) {
        let returned = match self.stats.as_mut().map(|q| q.pop_used()) {
            Some(Ok(Some(_))) => true,
            Some(Err(err)) => self.dev.fail(format_args!("stats queue: {err}")),
            _ => false,
        };
        if returned {
            self.send_stats();
        }
    }
}

/// Sends what the device must refuse, each answered without harm; then one good page.
fn hostile(driver: &mut Driver, dma: &mut Dma) {
    let past_ram = [u32::MAX, (driver.pages.top / PAGE) as u32 + 16];
    let mut bytes = [0u8; 8];
    bytes[..4].copy_from_slice(&past_ram[0].to_le_bytes());
    bytes[4..].copy_from_slice(&past_ram[1].to_le_bytes());
    write_ram(driver.pfn_buffer, &bytes);
    driver.submit(true, driver.pfn_buffer, 8);
    println!("{NAME}: hostile pfns past ram sent");
    let huge = dma.alloc(1 << 20, PAGE);
    driver.submit(true, huge, 1 << 20);
    println!("{NAME}: hostile huge inflate buffer sent");
    driver.submit(false, driver.pfn_buffer, 6);
    println!("{NAME}: hostile partial pfn sent");
    if let Some(queue) = driver.stats.as_mut() {
        if let Err(err) = queue.add(&[Buffer::readable(driver.stats_buffer, 7)], 0) {
            driver.dev.fail(format_args!("stats queue: {err}"));
        }
        queue.notify();
        println!("{NAME}: hostile stats buffer sent");
    }
}

pub fn run(info: &BootInfo, dma: &mut Dma, hostile_first: bool, touch_mib: u64) -> ! {
    let mut dev = VirtioPci::find(NAME, TYPE_BALLOON);
    let features = dev.initialize(F_STATS_VQ);
    dev.set_config_vector(NO_VECTOR);
    let inflate = dev.setup_queue(dma, 0, None);
    let deflate = dev.setup_queue(dma, 1, None);
    let stats = (features & F_STATS_VQ != 0).then(|| dev.setup_queue(dma, 2, None));
    dev.driver_ok();
    let pages = Pages::find(info);
    println!(
        "{NAME}: {} pages below {:#x} can be ballooned, stats {}",
        pages.count,
        pages.top,
        if stats.is_some() { "on" } else { "off" }
    );
    let touch = (touch_mib.saturating_mul(256)).min(u64::from(pages.count)) as u32;
    for i in 0..touch {
        crate::pattern::fill(pages.addr(i), PAGE, PATTERN_SEED);
    }
    println!("{NAME}: touched {touch} pages");
    let mut driver = Driver {
        dev,
        inflate,
        deflate,
        stats,
        pfn_buffer: dma.alloc(PAGE, PAGE),
        stats_buffer: dma.alloc(PAGE, PAGE),
        pages,
        held: 0,
        stats_sent: 0,
    };
    if hostile_first {
        hostile(&mut driver, dma);
        // The refused statistics buffer is the device's now; it gives it back at its next
        // poll, and the driver answers with good statistics.
    } else {
        driver.send_stats();
    }
    driver.report_actual();
    let mut clamped = false;
    loop {
        let mut target = driver.target();
        if target > driver.pages.count {
            if !clamped {
                println!(
                    "{NAME}: target {target} pages is more than the {} it can give",
                    driver.pages.count
                );
                clamped = true;
            }
            target = driver.pages.count;
        }
        if target > driver.held {
            driver.inflate_by((target - driver.held).min(PFNS_PER_BUFFER));
            if driver.held == target {
                driver.report_actual();
            }
        } else if target < driver.held {
            driver.deflate_by((driver.held - target).min(PFNS_PER_BUFFER));
            if driver.held == target {
                println!("{NAME}: deflated pages read as zero");
                driver.report_actual();
            }
        } else {
            driver.poll_stats();
            let wait = Deadline::after_ms(20);
            while !wait.expired() {
                crate::arch::pause();
            }
        }
    }
}
