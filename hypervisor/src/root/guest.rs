//! Loading the guest: from the boot loader's memory map and modules to a
//! Linux kernel ready at its 64-bit entry point (Documentation/arch/x86/boot.rst,
//! "64-bit boot protocol"). The decisions are the loader crate's; this module
//! only moves bytes.

use crate::phys;
use core::fmt;
use hypervisor::acpi;
use loader::layout::{self, Gpa};
use loader::multiboot::{self, Info, MultibootError};
use loader::{
    bootparams, e820::E820Kind, guest_tables, BootError, BzImageError, E820Map, GuestBootConfig,
};

/// Why the guest could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// The boot loader's information.
    Multiboot(MultibootError),
    /// The guest kernel image.
    Kernel(BzImageError),
    /// Placing the guest.
    Boot(BootError),
    /// Anything else, with a message.
    Other(&'static str),
}

impl fmt::Display for LoadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Multiboot(e) => write!(f, "boot loader: {e}"),
            Self::Kernel(e) => write!(f, "{e}"),
            Self::Boot(e) => write!(f, "{e}"),
            Self::Other(m) => f.write_str(m),
        }
    }
}

impl From<MultibootError> for LoadError {
    fn from(e: MultibootError) -> Self {
        Self::Multiboot(e)
    }
}
impl From<BzImageError> for LoadError {
    fn from(e: BzImageError) -> Self {
        Self::Kernel(e)
    }
}
impl From<BootError> for LoadError {
    fn from(e: BootError) -> Self {
        Self::Boot(e)
    }
}

/// The information the boot loader gave, before anything is loaded.
pub struct BootInfo {
    /// The guest's e820: the loader's map less hypervisor memory.
    pub e820: E820Map,
    /// Top of RAM (exclusive).
    pub ram_top: u64,
    /// The kernel module: (start, len) and its command line.
    kernel: (u64, usize),
    cmdline: &'static str,
    /// The initrd module, if any: (start, len).
    initrd: Option<(u64, u64)>,
}

fn c_str(addr: u32) -> &'static str {
    if addr == 0 {
        return "";
    }
    let Some(bytes) = phys::slice(addr as u64, 4096) else {
        return "";
    };
    let text = bytes.split(|&b| b == 0).next().unwrap_or_default();
    core::str::from_utf8(text).unwrap_or("")
}

/// The firmware's ACPI RSDP, searched in the BIOS area.
pub fn find_rsdp() -> Option<u64> {
    let bios = phys::slice(
        acpi::BIOS_AREA.start,
        (acpi::BIOS_AREA.end - acpi::BIOS_AREA.start) as usize,
    )?;
    acpi::find_rsdp(bios, acpi::BIOS_AREA.start)
}

/// The hypervisor's own Multiboot command line (empty when the boot loader
/// gave none or the information is unusable; `boot_info` reports that).
pub fn own_cmdline(magic: u32, mbi: u32) -> &'static str {
    phys::slice(mbi as u64, multiboot::INFO_SIZE)
        .and_then(|bytes| Info::parse(magic, bytes).ok())
        .and_then(|info| info.cmdline)
        .map_or("", c_str)
}

/// Reads the multiboot information and carves hypervisor memory out of the map.
pub fn boot_info(magic: u32, mbi: u32) -> Result<BootInfo, LoadError> {
    let info_bytes = phys::slice(mbi as u64, multiboot::INFO_SIZE)
        .ok_or(LoadError::Other("multiboot info out of range"))?;
    let info = Info::parse(magic, info_bytes)?;
    let (mmap_len, mmap_addr) = info.mmap.ok_or(MultibootError::NoMemoryMap)?;
    let map =
        phys::slice(mmap_addr as u64, mmap_len as usize).ok_or(MultibootError::BadMemoryMap)?;
    let mut e820 = E820Map::new();
    let mut ram_top = 0;
    for entry in multiboot::mmap_entries(map) {
        let entry = entry?;
        if entry.len == 0 {
            continue;
        }
        let kind = E820Kind::from_raw(entry.kind);
        if kind == E820Kind::Ram {
            ram_top = ram_top.max(entry.base.saturating_add(entry.len));
        }
        e820.add(entry.base, entry.len, kind)
            .map_err(|_| LoadError::Other("memory map has more than 128 entries"))?;
    }
    e820.sanitize()
        .map_err(|_| LoadError::Other("memory map cannot be sanitized"))?;
    e820.remove_range(layout::HV_RESERVED.as_u64(), layout::HV_RESERVED_SIZE)
        .map_err(|_| LoadError::Other("memory map full while reserving hypervisor memory"))?;
    e820.remove_range(layout::AP_TRAMPOLINE.as_u64(), layout::PAGE_SIZE)
        .map_err(|_| LoadError::Other("memory map full while reserving the AP start-up page"))?;

    let (count, addr) = info.mods.ok_or(MultibootError::NoModules)?;
    if count == 0 {
        return Err(MultibootError::NoModules.into());
    }
    let descs = phys::slice(addr as u64, count as usize * multiboot::MODULE_SIZE)
        .ok_or(MultibootError::NoModules)?;
    let mut mods = multiboot::modules(descs);
    let k = mods.next().ok_or(MultibootError::NoModules)?;
    let (_, cmdline) = multiboot::split_module_string(c_str(k.string));
    let initrd = mods
        .next()
        .filter(|m| !m.is_empty())
        .map(|m| (m.start as u64, m.len() as u64));
    if k.is_empty() {
        return Err(LoadError::Other("guest kernel module is empty"));
    }
    Ok(BootInfo {
        e820,
        ram_top,
        kernel: (k.start as u64, k.len() as usize),
        cmdline,
        initrd,
    })
}

/// Where the guest starts.
pub struct GuestEntry {
    /// 64-bit entry point (load address + 0x200).
    pub rip: u64,
    /// Physical address of the zero page, passed in RSI.
    pub boot_params: u64,
    /// The guest's initial CR3.
    pub cr3: u64,
    /// GDT base and limit.
    pub gdt: (u64, u16),
    /// The guest's code and data selectors.
    pub selectors: (u16, u16),
    /// Where the kernel's protected-mode part was copied.
    pub load: u64,
}

/// Loads the kernel, command line, boot_params, GDT and boot page tables.
pub fn load(b: &BootInfo, rsdp: Option<u64>) -> Result<GuestEntry, LoadError> {
    let image = phys::slice(b.kernel.0, b.kernel.1)
        .ok_or(LoadError::Other("guest kernel module out of range"))?;
    let img = loader::parse_bzimage(image)?;

    const LOW: usize = layout::LOW_BOOT_STRUCTURES.len();
    let mut avoid = [(0u64, 0u64); LOW + 2];
    avoid[..LOW].copy_from_slice(&layout::LOW_BOOT_STRUCTURES);
    avoid[LOW] = (b.kernel.0, b.kernel.1 as u64);
    avoid[LOW + 1] = b.initrd.unwrap_or((0, 0));
    let load = loader::plan_kernel_load(&img, &b.e820, &avoid)?;
    let pm = img.protected_mode();
    if !phys::write(load.as_u64(), pm) {
        return Err(LoadError::Other("kernel load address out of range"));
    }

    let cmd = b.cmdline.as_bytes();
    if cmd.len() as u64 + 1 > layout::COMMAND_LINE_MAX {
        return Err(LoadError::Other("guest command line longer than 64 KiB"));
    }
    phys::write(layout::CMDLINE.as_u64(), cmd);
    phys::write(layout::CMDLINE.as_u64() + cmd.len() as u64, &[0]);

    let cfg = GuestBootConfig {
        cmdline_addr: layout::CMDLINE,
        cmdline_len: cmd.len(),
        initrd: b.initrd.map(|(a, l)| (Gpa(a), l)),
        acpi_rsdp: rsdp.map(Gpa),
    };
    let bp = bootparams::build(&img, &cfg, &b.e820)?;
    phys::write(layout::ZERO_PAGE.as_u64(), &bp.to_bytes());
    phys::write(layout::GDT.as_u64(), &guest_tables::gdt_bytes());
    let mut tables = [0u8; guest_tables::IDENTITY_TABLES_SIZE];
    guest_tables::write_identity_tables(&mut tables, layout::BOOT_PML4);
    phys::write(layout::BOOT_PML4.as_u64(), &tables);

    Ok(GuestEntry {
        rip: loader::entry_point(load).as_u64(),
        boot_params: layout::ZERO_PAGE.as_u64(),
        cr3: layout::BOOT_PML4.as_u64(),
        gdt: (layout::GDT.as_u64(), (layout::GDT_SIZE - 1) as u16),
        selectors: (layout::GUEST_CODE_SELECTOR, layout::GUEST_DATA_SELECTOR),
        load: load.as_u64(),
    })
}
