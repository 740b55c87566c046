//! Ring-0 boot code, descriptor tables, page tables and per-CPU memory layout.
//!
//! Every ring-0 instruction is emulated by the hypervisor (~0.4 us each), so ring 0 only does
//! what ring 3 cannot: load CR3/CR4/EFER/CR0, GDT, TSS, IDT, and `iretq` to ring 3. Everything
//! that can be static (page tables, GDT, IDT, iret frames) is prebuilt in the image; the GDT and
//! IDT are in the linker script because their descriptors split addresses into bit fields.
//!
//! Exceptions go to 16-byte stubs which, still in ring 0, build an iret frame to
//! [`crate::exception::tg_exception_report`] in ring 3 on a per-CPU report stack.

use core::ptr::addr_of_mut;

/// Most CPUs the guest supports (GDT TSS slots, per-CPU stacks).
pub const MAX_CPUS: usize = 64;

pub const KERNEL_CODE_SELECTOR: u16 = 0x08;
pub const USER_DATA_SELECTOR: u16 = 0x18 | 3;
pub const USER_CODE_SELECTOR: u16 = 0x20 | 3;
/// TSS descriptor of CPU 0; CPU `i` uses `FIRST_TSS_SELECTOR + 16 * i`.
pub const FIRST_TSS_SELECTOR: u16 = 0x28;
const GDT_LIMIT: usize = 0x28 + MAX_CPUS * 16 - 1;
/// 256 gates: 0..31 are the exception stubs (linker script); the rest start not present and
/// ring 3 fills the ones it uses (the `pci` workload's MSI vector).
pub const IDT_ENTRIES: usize = 256;
const IDT_LIMIT: usize = IDT_ENTRIES * 16 - 1;

/// RFLAGS for ring 3: IOPL=3 (port I/O allowed), IF=0, reserved bit 1.
pub const USER_RFLAGS: u64 = 0x3002;

/// CR0: PE | MP | ET | NE | PG (EM, TS, CD, NW clear: SSE usable, caches on).
const CR0_VALUE: u32 = 0x8000_0033;
/// CR4: PAE | OSFXSR | OSXMMEXCPT.
const CR4_VALUE: u32 = 0x620;
/// EFER: LME.
const EFER_VALUE: u32 = 0x100;

/// Page table entry flags: present, writable, user, accessed (preset so the CPU never has to
/// write the tables back, which would trap under shadow paging).
pub const TABLE_FLAGS: u64 = 0x27;
/// Large page leaf: the table flags plus dirty and PS.
pub const LARGE_PAGE_FLAGS: u64 = 0xE7;

/// Guest-physical space identity mapped (user accessible) from 0: RAM, and BARs where the
/// VMM's 64-bit window starts right above RAM (Intel hosts).
pub const MAPPED_LIMIT: u64 = 64 << 30;
/// A second identity-mapped range, 64 GiB from 1 TiB: where gpuvm's 64-bit PCI window
/// starts on AMD hosts (past the HyperTransport range 1012 GiB..1 TiB), so the BARs placed
/// first (virtio devices', GPUs' first) are reachable there too.
pub const WINDOW_MAP_START: u64 = 1 << 40;
const WINDOW_GIB: usize = 64;
pub const WINDOW_MAP_END: u64 = WINDOW_MAP_START + ((WINDOW_GIB as u64) << 30);

/// Whether `[start, start + len)` lies in one identity-mapped range (below [`MAPPED_LIMIT`]
/// or in [`WINDOW_MAP_START`]..[`WINDOW_MAP_END`]).
pub fn is_mapped(start: u64, len: u64) -> bool {
    let Some(end) = start.checked_add(len) else {
        return false;
    };
    end <= MAPPED_LIMIT || (start >= WINDOW_MAP_START && end <= WINDOW_MAP_END)
}
/// The first 4 GiB are mapped statically with 2 MiB pages; ring 3 maps the rest.
const STATIC_GIB: usize = 4;
const HIGH_GIB: usize = (MAPPED_LIMIT >> 30) as usize - STATIC_GIB;

/// Per-CPU block, ascending: ring-3 stack, ring-3 exception report stack, ring-0 stack.
/// The exception stub finds the report stack by rounding its ring-0 stack pointer down to 4 KiB.
pub const PERCPU_SIZE: usize = 64 * 1024;
pub const USER_STACK_SIZE: usize = 40 * 1024;
pub const REPORT_STACK_SIZE: usize = 20 * 1024;
/// Exactly one 4 KiB page, 4 KiB aligned: the exception stub relies on it.
pub const KERNEL_STACK_SIZE: usize = 4096;
const _: () = assert!(USER_STACK_SIZE + REPORT_STACK_SIZE + KERNEL_STACK_SIZE == PERCPU_SIZE);
const _: () = assert!(PERCPU_SIZE.is_multiple_of(4096));
const TSS_SLOT_SIZE: usize = 128;

/// Trampoline destination below 1 MiB and the matching SIPI vector (page number).
pub const TRAMPOLINE_PADDR: u64 = 0x8000;
pub const TRAMPOLINE_SIPI_VECTOR: u32 = (TRAMPOLINE_PADDR >> 12) as u32;

core::arch::global_asm!(
    r#"
    .globl tg_max_cpus
    .set tg_max_cpus, {max_cpus}

    /* Xen PVH entry note: XEN_ELFNOTE_PHYS32_ENTRY (18), name "Xen", 32-bit entry address. */
    .section .note.Xen, "a", @note
    .p2align 2
    .long 4
    .long 4
    .long 18
    .asciz "Xen"
    .p2align 2
    .long tg_start32

    .section .text.tg_boot, "ax", @progbits

    /* PVH entry: 32-bit protected mode, paging off, %ebx = hvm_start_info. */
    .code32
    .globl tg_start32
tg_start32:
    movl %ebx, tg_start_info_paddr
    lgdtl tg_gdt_ptr
    movl $tg_pml4, %eax
    movl %eax, %cr3
    movl ${cr4}, %eax
    movl %eax, %cr4
    movl $0xC0000080, %ecx
    movl ${efer}, %eax
    xorl %edx, %edx
    wrmsr
    movl ${cr0}, %eax
    movl %eax, %cr0
    ljmpl ${kcode}, $tg_bsp_long64

    .code64
tg_bsp_long64:
    movw ${tss0}, %ax
    ltr %ax
    lidt tg_idt_ptr
    movl $tg_bsp_iret_frame, %esp
    iretq

    /* AP, after the trampoline: the BSP (ring 3) filled tg_ap_tss_sel and tg_ap_iret_frame. */
    .globl tg_ap_long64
tg_ap_long64:
    movw tg_ap_tss_sel, %ax
    ltr %ax
    lidt tg_idt_ptr
    movl $tg_ap_iret_frame, %esp
    iretq

    /* AP real-mode trampoline, copied by ring 3 to TRAMPOLINE_PADDR (SIPI vector = its page).
       Goes from real mode straight to long mode (CR0.PE and PG together), then far-jumps into
       the image. CS base is the trampoline page, so the GDT pointer is addressed through %cs. */
    .code16
    .globl tg_tramp_start
tg_tramp_start:
    lgdtl %cs:(tg_tramp_gdtr - tg_tramp_start)
    movl ${cr4}, %eax
    movl %eax, %cr4
    movl $tg_pml4, %eax
    movl %eax, %cr3
    movl $0xC0000080, %ecx
    movl ${efer}, %eax
    xorl %edx, %edx
    wrmsr
    movl ${cr0}, %eax
    movl %eax, %cr0
    ljmpl ${kcode}, $tg_ap_long64
    .p2align 2
tg_tramp_gdtr:
    .word {gdt_limit}
    .long tg_gdt
    .globl tg_tramp_end
tg_tramp_end:
    .code64

    /* Exception stubs, exactly 16 bytes apart (the linker-script IDT relies on it). */
    .macro TG_EXC_STUB vec, has_err
    .p2align 4
    .if \vec == 13
    jmp tg_gp_entry
    .else
    .if \has_err == 0
    pushq $0
    .endif
    pushq $\vec
    jmp tg_exc_common
    .endif
    .endm

    .p2align 4
    .globl tg_exc_stubs
tg_exc_stubs:
    TG_EXC_STUB 0, 0
    TG_EXC_STUB 1, 0
    TG_EXC_STUB 2, 0
    TG_EXC_STUB 3, 0
    TG_EXC_STUB 4, 0
    TG_EXC_STUB 5, 0
    TG_EXC_STUB 6, 0
    TG_EXC_STUB 7, 0
    TG_EXC_STUB 8, 1
    TG_EXC_STUB 9, 0
    TG_EXC_STUB 10, 1
    TG_EXC_STUB 11, 1
    TG_EXC_STUB 12, 1
    TG_EXC_STUB 13, 1
    TG_EXC_STUB 14, 1
    TG_EXC_STUB 15, 0
    TG_EXC_STUB 16, 0
    TG_EXC_STUB 17, 1
    TG_EXC_STUB 18, 0
    TG_EXC_STUB 19, 0
    TG_EXC_STUB 20, 0
    TG_EXC_STUB 21, 1
    TG_EXC_STUB 22, 0
    TG_EXC_STUB 23, 0
    TG_EXC_STUB 24, 0
    TG_EXC_STUB 25, 0
    TG_EXC_STUB 26, 0
    TG_EXC_STUB 27, 0
    TG_EXC_STUB 28, 0
    TG_EXC_STUB 29, 1
    TG_EXC_STUB 30, 1
    TG_EXC_STUB 31, 0
    .globl tg_exc_stubs_end
tg_exc_stubs_end:

    /* #GP. This hypervisor's emulated iretq drops RFLAGS.IOPL, so port I/O from ring 3 faults;
       do the faulting I/O instruction here with the ring-3 registers and return after it.
       Forms: f3 6e rep outsb (a whole line, sent byte by byte), ef out eax, ee out al, 66 ef out ax,
       ed in eax, ec in al, 66 ed in ax. f4 hlt: wait for an interrupt here with `sti; hlt`
       (interrupts are only delivered in ring 0 on this hypervisor), then return after the hlt.
       Anything else is a real #GP.
       Stack: rbx, rax, error code, rip, cs, rflags, rsp, ss. */
tg_gp_entry:
    pushq %rax
    pushq %rbx
    testb $3, 32(%rsp)
    jz .Lgp_fault
    movq 24(%rsp), %rbx
    movzwl (%rbx), %eax
    cmpw $0x6ef3, %ax
    je .Lgp_rep_outsb
    cmpb $0xef, %al
    je .Lgp_out32
    cmpb $0xee, %al
    je .Lgp_out8
    cmpb $0xed, %al
    je .Lgp_in32
    cmpb $0xec, %al
    je .Lgp_in8
    cmpw $0xef66, %ax
    je .Lgp_out16
    cmpw $0xed66, %ax
    je .Lgp_in16
    cmpb $0xf4, %al
    je .Lgp_hlt
.Lgp_fault:
    popq %rbx
    popq %rax
    pushq $13
    jmp tg_exc_common
.Lgp_rep_outsb:
    popq %rbx
    popq %rax
    /* Byte by byte, not rep outsb: one exit per byte, because a VMM may take a string I/O
       exit (count > 1) as a single access. Same end state as rep outsb (rcx 0, rsi past). */
    jrcxz .Lgp_done2
1:  outsb
    loop 1b
    jmp .Lgp_done2
.Lgp_out32:
    popq %rbx
    popq %rax
    outl %eax, %dx
    jmp .Lgp_done1
.Lgp_out8:
    popq %rbx
    popq %rax
    outb %al, %dx
    jmp .Lgp_done1
.Lgp_in32:
    popq %rbx
    popq %rax
    inl %dx, %eax
    jmp .Lgp_done1
.Lgp_in8:
    popq %rbx
    popq %rax
    inb %dx, %al
    jmp .Lgp_done1
.Lgp_out16:
    popq %rbx
    popq %rax
    outw %ax, %dx
    jmp .Lgp_done2
.Lgp_in16:
    popq %rbx
    popq %rax
    inw %dx, %ax
    jmp .Lgp_done2
.Lgp_hlt:
    popq %rbx
    popq %rax
    sti
    hlt
    cli
    jmp .Lgp_done1
.Lgp_done1:
    addq $1, 8(%rsp)
    addq $8, %rsp
    iretq
.Lgp_done2:
    addq $2, 8(%rsp)
    addq $8, %rsp
    iretq

    /* Stack: vector, error code, then the CPU's frame (rip, cs, rflags, rsp, ss).
       Report in ring 3: tg_exception_report(vector, error, rip, cr2). */
tg_exc_common:
    popq %rdi
    popq %rsi
    movq (%rsp), %rdx
    movq %cr2, %rcx
    testb $3, 8(%rsp)
    jz 1f
    /* From ring 3: the stack is this CPU's 4 KiB ring-0 stack; its base is the top of the
       CPU's report stack. */
    movq %rsp, %rax
    andq $-4096, %rax
    jmp 2f
1:  movl $tg_emergency_stack_top, %eax
2:  subq $8, %rax
    pushq ${udata}
    pushq %rax
    pushq ${rflags}
    pushq ${ucode}
    pushq $tg_exception_report
    iretq

    .section .data.tg_boot, "aw", @progbits
    .p2align 4
tg_gdt_ptr:
    .word {gdt_limit}
    .quad tg_gdt
    .p2align 4
tg_idt_ptr:
    .word {idt_limit}
    .quad tg_idt
    .p2align 3
    .globl tg_start_info_paddr
tg_start_info_paddr:
    .quad 0
    .globl tg_ap_tss_sel
tg_ap_tss_sel:
    .quad 0
    .p2align 4
tg_bsp_iret_frame:
    .quad tg_bsp_main
    .quad {ucode}
    .quad {rflags}
    .quad tg_percpu + {ustack_top}
    .quad {udata}
    .globl tg_ap_iret_frame
tg_ap_iret_frame:
    .zero 40

    /* One 128-byte slot per CPU; only CPU 0's TSS is static (rsp0, I/O map base = limit). */
    .p2align 7
    .globl tg_tss
tg_tss:
    .long 0
    .quad tg_percpu + {percpu_size}
    .zero 88
    .word 0
    .word 104
    .zero {tss_slot} - 104
    .zero {tss_slot} * ({max_cpus} - 1)

    /* Identity map, user accessible, 2 MiB pages for the first 4 GiB. */
    .section .data.tg_pagetables, "aw", @progbits
    .p2align 12
    .globl tg_pml4
tg_pml4:
    .quad tg_pdpt + {table_flags}
    .zero 4088
    .globl tg_pdpt
tg_pdpt:
    .quad tg_pd_low + {table_flags}
    .quad tg_pd_low + 0x1000 + {table_flags}
    .quad tg_pd_low + 0x2000 + {table_flags}
    .quad tg_pd_low + 0x3000 + {table_flags}
    .zero 4096 - 32
tg_pd_low:
    .set tg_pde, {large_flags}
    .rept 2048
    .quad tg_pde
    .set tg_pde, tg_pde + 0x200000
    .endr

    .section .bss.tg_boot, "aw", @nobits
    .p2align 12
    .globl tg_percpu
tg_percpu:
    .zero {percpu_size} * {max_cpus}
    .globl tg_pd_high
tg_pd_high:
    .zero 4096 * {high_gib}
    .globl tg_pdpt_window
tg_pdpt_window:
    .zero 4096
    .globl tg_pd_window
tg_pd_window:
    .zero 4096 * {window_gib}
tg_emergency_stack:
    .zero 16384
tg_emergency_stack_top:
    .text
"#,
    max_cpus = const MAX_CPUS,
    cr0 = const CR0_VALUE,
    cr4 = const CR4_VALUE,
    efer = const EFER_VALUE,
    kcode = const KERNEL_CODE_SELECTOR,
    ucode = const USER_CODE_SELECTOR,
    udata = const USER_DATA_SELECTOR,
    tss0 = const FIRST_TSS_SELECTOR,
    rflags = const USER_RFLAGS,
    gdt_limit = const GDT_LIMIT,
    idt_limit = const IDT_LIMIT,
    ustack_top = const USER_STACK_SIZE - 8,
    percpu_size = const PERCPU_SIZE,
    tss_slot = const TSS_SLOT_SIZE,
    table_flags = const TABLE_FLAGS,
    large_flags = const LARGE_PAGE_FLAGS,
    high_gib = const HIGH_GIB,
    window_gib = const WINDOW_GIB,
    options(att_syntax)
);

extern "C" {
    static tg_start_info_paddr: u64;
    static mut tg_ap_tss_sel: u64;
    static mut tg_ap_iret_frame: [u64; 5];
    static mut tg_tss: [u8; TSS_SLOT_SIZE * MAX_CPUS];
    static mut tg_gdt: [u64; 5 + 2 * MAX_CPUS];
    static mut tg_pdpt: [u64; 512];
    static mut tg_pd_high: [u64; 512 * HIGH_GIB];
    static mut tg_pml4: [u64; 512];
    static mut tg_pdpt_window: [u64; 512];
    static mut tg_pd_window: [u64; 512 * WINDOW_GIB];
    static mut tg_percpu: [u8; PERCPU_SIZE * MAX_CPUS];
    static tg_tramp_start: u8;
    static tg_tramp_end: u8;
}

/// Physical address of `hvm_start_info`, as the PVH entry got it in %ebx.
pub fn start_info_paddr() -> u64 {
    // SAFETY: written once by the ring-0 entry code before ring 3 started; read-only since.
    unsafe { core::ptr::read_volatile(&raw const tg_start_info_paddr) }
}

fn percpu_base(cpu: usize) -> u64 {
    // Only the address is taken; cpu < MAX_CPUS keeps it inside the array.
    addr_of_mut!(tg_percpu) as u64 + (cpu * PERCPU_SIZE) as u64
}

/// Maps guest-physical 4 GiB .. 64 GiB and 1 TiB .. 1 TiB + 64 GiB (identity, user) with
/// 2 MiB pages. Runs once in ring 3 on the BSP before any other CPU starts: the page tables
/// are user accessible, and the entries written were not present before, so no TLB entry
/// can be stale.
///
/// Not 1 GiB pages: under kvm_pvm, CPUID reports pdpe1gb but a 1 GiB PDPT entry faults with a
/// reserved-bit #PF (the shadow MMU does not accept it), so it cannot be trusted.
pub fn map_high_memory() {
    // SAFETY: the page tables are this image's statics; only not-present entries (PDPT
    // entries 4..64, PML4 entry 2 and the window's PDPT) and the unused directories are
    // written, while only this CPU runs.
    unsafe {
        let pdpt = addr_of_mut!(tg_pdpt) as *mut u64;
        let pds = addr_of_mut!(tg_pd_high) as *mut u64;
        map_gibs(pdpt, pds, STATIC_GIB, HIGH_GIB, 0);
        let window_pdpt = addr_of_mut!(tg_pdpt_window) as *mut u64;
        let window_pds = addr_of_mut!(tg_pd_window) as *mut u64;
        map_gibs(window_pdpt, window_pds, 0, WINDOW_GIB, WINDOW_MAP_START);
        let pml4 = addr_of_mut!(tg_pml4) as *mut u64;
        let slot = (WINDOW_MAP_START >> 39) as usize;
        pml4.add(slot)
            .write_volatile(window_pdpt as u64 | TABLE_FLAGS);
    }
}

/// Fills `count` page directories at `pds` with 2 MiB pages of guest-physical `base` +
/// (`first` + n) GiB and links each into `pdpt` at index `first` + n.
///
/// # Safety
/// `pdpt` and `pds` are unused (not present, not linked) tables of this image with room for
/// the entries written.
unsafe fn map_gibs(pdpt: *mut u64, pds: *mut u64, first: usize, count: usize, base: u64) {
    for gib in first..first + count {
        let address = base + ((gib as u64) << 30);
        // Fill the directory before linking it, so a walk never sees it half done; it is
        // not a page table yet, so these writes do not trap under shadow paging.
        // SAFETY: as the caller promises.
        unsafe {
            let pd = pds.add((gib - first) * 512);
            for i in 0..512u64 {
                pd.add(i as usize)
                    .write_volatile((address + (i << 21)) | LARGE_PAGE_FLAGS);
            }
            pdpt.add(gib).write_volatile(pd as u64 | TABLE_FLAGS);
        }
    }
}

/// The real-mode AP trampoline bytes (to be copied to [`TRAMPOLINE_PADDR`]).
pub fn trampoline() -> &'static [u8] {
    // SAFETY: the two symbols delimit the trampoline inside the loaded image text.
    unsafe {
        let start = &raw const tg_tramp_start;
        let end = &raw const tg_tramp_end;
        core::slice::from_raw_parts(start, end as usize - start as usize)
    }
}

/// Prepares CPU `cpu`'s TSS and GDT descriptor and the ring-0 AP entry parameters
/// (TSS selector, iret frame to `entry` on the CPU's ring-3 stack). The BSP calls it before each
/// SIPI; APs start one at a time, so one set of parameters is enough.
pub fn prepare_ap_boot(cpu: usize, entry: extern "sysv64" fn() -> !) {
    assert!(cpu > 0 && cpu < MAX_CPUS);
    let base = percpu_base(cpu);
    // SAFETY: writes this image's descriptor tables for a CPU slot not in use yet; the AP reads
    // them only after the SIPI that follows.
    unsafe {
        let tss = (addr_of_mut!(tg_tss) as *mut u8).add(cpu * TSS_SLOT_SIZE);
        tss.add(4)
            .cast::<u64>()
            .write_unaligned(base + PERCPU_SIZE as u64);
        tss.add(102).cast::<u16>().write_unaligned(104);
        let tss_addr = tss as u64;
        let low = 0x67
            | (tss_addr & 0xffff) << 16
            | ((tss_addr >> 16) & 0xff) << 32
            | 0x89 << 40
            | ((tss_addr >> 24) & 0xff) << 56;
        let gdt = addr_of_mut!(tg_gdt) as *mut u64;
        let slot = 5 + 2 * cpu;
        gdt.add(slot).write_volatile(low);
        gdt.add(slot + 1).write_volatile(tss_addr >> 32);
        (&raw mut tg_ap_tss_sel).write_volatile((FIRST_TSS_SELECTOR as usize + 16 * cpu) as u64);
        let frame = addr_of_mut!(tg_ap_iret_frame) as *mut u64;
        frame.add(0).write_volatile(entry as usize as u64);
        frame.add(1).write_volatile(USER_CODE_SELECTOR as u64);
        frame.add(2).write_volatile(USER_RFLAGS);
        frame
            .add(3)
            .write_volatile(base + USER_STACK_SIZE as u64 - 8);
        frame.add(4).write_volatile(USER_DATA_SELECTOR as u64);
    }
}
