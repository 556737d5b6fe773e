//! The machine's GPUs and the links between them, for placing tensor-parallel ranks.
//!
//! Read from the CUDA driver (through cudarc, which loads libcuda at run time): name, memory,
//! compute capability and PCI bus id per GPU, and for every ordered pair whether peer access is
//! supported (`cuDeviceCanAccessPeer`) and the pair's P2P attributes (`cuDeviceGetP2PAttribute`).
//! The driver does not name the link; [`LinkKind::classify`] infers it: peer access with native
//! atomics is NVLink (PCIe peer-to-peer does not carry native atomics), peer access without them
//! is PCIe, and no peer access is "none" (traffic goes through host memory).
//!
//! [`suggest_tp_pairs`] is pure, so placement is tested on synthetic inventories.

use std::fmt;

use cudarc::driver::{CudaContext, result, sys};

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA device ordinal.
    pub index: usize,
    pub name: String,
    pub memory_total: u64,
    /// Free memory; `None` when the device could not be opened to ask.
    pub memory_free: Option<u64>,
    pub compute_capability: (i32, i32),
    /// `domain:bus:device.function`, as the driver prints it.
    pub pci_bus_id: String,
}

/// How two GPUs reach each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkKind {
    /// Peer access over NVLink (or NVSwitch).
    NvLink,
    /// Peer access over PCIe.
    Pcie,
    /// No peer access: copies are staged through host memory.
    None,
}

impl LinkKind {
    /// The link a pair's P2P attributes imply (see the module documentation).
    pub fn classify(access_supported: bool, native_atomics: bool) -> LinkKind {
        match (access_supported, native_atomics) {
            (true, true) => LinkKind::NvLink,
            (true, false) => LinkKind::Pcie,
            (false, _) => LinkKind::None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            LinkKind::NvLink => "nvlink",
            LinkKind::Pcie => "pcie",
            LinkKind::None => "none",
        }
    }
}

impl fmt::Display for LinkKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The link from GPU `from` to GPU `to` (the driver reports each direction).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerLink {
    pub from: usize,
    pub to: usize,
    /// `cuDeviceCanAccessPeer`: `from` can map `to`'s memory.
    pub p2p_access: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED`.
    pub native_atomics: bool,
    /// `CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK`: the driver's relative rank of the link.
    pub performance_rank: i32,
    pub kind: LinkKind,
}

/// Every GPU of the machine and the links between every ordered pair.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Inventory {
    /// `cuDriverGetVersion`: e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    pub gpus: Vec<GpuInfo>,
    /// One entry per ordered pair `(from, to)`, `from != to`.
    pub links: Vec<PeerLink>,
}

impl Inventory {
    /// The link from `from` to `to`, if both are in the inventory and differ.
    pub fn link(&self, from: usize, to: usize) -> Option<&PeerLink> {
        self.links.iter().find(|l| l.from == from && l.to == to)
    }

    /// The weaker of the two directions between `a` and `b` (`None` when either is unknown).
    pub fn pair_kind(&self, a: usize, b: usize) -> LinkKind {
        match (self.link(a, b), self.link(b, a)) {
            (Some(x), Some(y)) => x.kind.max(y.kind),
            _ => LinkKind::None,
        }
    }
}

/// Why no inventory could be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InventoryError {
    /// There is no NVIDIA driver (libcuda) on this machine.
    #[error("no NVIDIA driver found (looked in: {}): 0 GPUs", looked.join(", "))]
    NoDriver { looked: Vec<String> },
    #[error("CUDA driver: {call} failed: {message}")]
    Driver { call: String, message: String },
}

/// Reads the inventory from the CUDA driver. Opens each GPU's primary context briefly to read its
/// free memory.
pub fn inspect() -> Result<Inventory, InventoryError> {
    // SAFETY: only tries to dlopen libcuda by its known names. cudarc panics on first use of the
    // driver when it is missing, so this check comes before any driver call.
    if !unsafe { sys::is_culib_present() } {
        return Err(InventoryError::NoDriver {
            looked: vec![
                "the loader path (LD_LIBRARY_PATH, ldconfig) for libcuda.so.1 and the other names \
                 cudarc tries; libcuda ships with the NVIDIA driver"
                    .to_string(),
            ],
        });
    }
    match result::init() {
        // The driver is installed but sees no GPU.
        Err(result::DriverError(sys::cudaError_enum::CUDA_ERROR_NO_DEVICE)) => {
            return Ok(Inventory::default());
        }
        other => other.map_err(driver("cuInit"))?,
    }
    let mut driver_version = 0;
    // SAFETY: the out-pointer is valid for the call.
    unsafe { sys::cuDriverGetVersion(&mut driver_version) }
        .result()
        .map_err(driver("cuDriverGetVersion"))?;
    let count = result::device::get_count().map_err(driver("cuDeviceGetCount"))?;
    let devices = (0..count)
        .map(|i| result::device::get(i).map_err(driver(format!("cuDeviceGet({i})"))))
        .collect::<Result<Vec<_>, _>>()?;
    let gpus = devices
        .iter()
        .enumerate()
        .map(|(index, &dev)| gpu_info(index, dev))
        .collect::<Result<Vec<_>, _>>()?;
    let mut links = Vec::new();
    for (from, &src) in devices.iter().enumerate() {
        for (to, &dst) in devices.iter().enumerate() {
            if from != to {
                links.push(peer_link(from, src, to, dst)?);
            }
        }
    }
    Ok(Inventory {
        driver_version,
        gpus,
        links,
    })
}

fn gpu_info(index: usize, dev: sys::CUdevice) -> Result<GpuInfo, InventoryError> {
    use sys::CUdevice_attribute::*;
    let name = result::device::get_name(dev).map_err(driver("cuDeviceGetName"))?;
    // SAFETY: `dev` came from cuDeviceGet.
    let (total, major, minor) = unsafe {
        (
            result::device::total_mem(dev).map_err(driver("cuDeviceTotalMem"))?,
            result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
                .map_err(driver("cuDeviceGetAttribute"))?,
            result::device::get_attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
                .map_err(driver("cuDeviceGetAttribute"))?,
        )
    };
    let mut bus = [0u8; 64];
    // SAFETY: the buffer's length is passed; the driver writes a NUL-terminated string into it.
    unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr().cast(), bus.len() as i32, dev) }
        .result()
        .map_err(driver("cuDeviceGetPCIBusId"))?;
    let pci_bus_id = std::ffi::CStr::from_bytes_until_nul(&bus)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    // Free memory needs a context; a GPU that cannot be opened (busy, exclusive mode) still lists.
    let memory_free = CudaContext::new(index)
        .and_then(|ctx| ctx.mem_get_info())
        .ok()
        .map(|(free, _)| free as u64);
    Ok(GpuInfo {
        index,
        name,
        memory_total: total as u64,
        memory_free,
        compute_capability: (major, minor),
        pci_bus_id,
    })
}

fn peer_link(
    from: usize,
    src: sys::CUdevice,
    to: usize,
    dst: sys::CUdevice,
) -> Result<PeerLink, InventoryError> {
    use sys::CUdevice_P2PAttribute::*;
    let mut can = 0;
    // SAFETY: both devices came from cuDeviceGet; the out-pointer is valid.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, src, dst) }
        .result()
        .map_err(driver("cuDeviceCanAccessPeer"))?;
    let attribute = |attr| {
        let mut value = 0;
        // SAFETY: as above.
        unsafe { sys::cuDeviceGetP2PAttribute(&mut value, attr, src, dst) }
            .result()
            .map(|()| value)
            .map_err(driver("cuDeviceGetP2PAttribute"))
    };
    let access = attribute(CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED)? != 0 && can != 0;
    let native_atomics = attribute(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED)? != 0;
    let performance_rank = attribute(CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK)?;
    Ok(PeerLink {
        from,
        to,
        p2p_access: access,
        native_atomics,
        performance_rank,
        kind: LinkKind::classify(access, native_atomics),
    })
}

fn driver<E: fmt::Debug>(call: impl Into<String>) -> impl FnOnce(E) -> InventoryError {
    let call = call.into();
    move |e| InventoryError::Driver {
        call,
        message: format!("{e:?}"),
    }
}

/// Two GPUs to run a TP = 2 group on, and the weaker direction of the link between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpPair {
    pub a: usize,
    pub b: usize,
    pub link: LinkKind,
}

/// Disjoint GPU pairs for TP = 2 groups: NVLink pairs first, then PCIe peer-to-peer pairs; GPUs
/// with no peer access to any free GPU are left out. Greedy over pairs ordered by link, then by
/// index, so the answer is deterministic; on the usual topologies (NVLink pairs, an NVSwitch, a
/// PCIe switch) it pairs every GPU that can be paired.
pub fn suggest_tp_pairs(inventory: &Inventory) -> Vec<TpPair> {
    let indices: Vec<usize> = inventory.gpus.iter().map(|g| g.index).collect();
    let mut candidates: Vec<TpPair> = Vec::new();
    for (i, &a) in indices.iter().enumerate() {
        for &b in &indices[i + 1..] {
            let link = inventory.pair_kind(a, b);
            if link != LinkKind::None {
                candidates.push(TpPair { a, b, link });
            }
        }
    }
    candidates.sort_by_key(|p| (p.link, p.a, p.b));
    let mut used: Vec<usize> = Vec::new();
    let mut pairs = Vec::new();
    for pair in candidates {
        if !used.contains(&pair.a) && !used.contains(&pair.b) {
            used.extend([pair.a, pair.b]);
            pairs.push(pair);
        }
    }
    pairs
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(index: usize) -> GpuInfo {
        GpuInfo {
            index,
            name: "test GPU".into(),
            memory_total: 80 << 30,
            memory_free: Some(79 << 30),
            compute_capability: (9, 0),
            pci_bus_id: format!("00000000:{:02x}:00.0", 0x10 + index),
        }
    }

    /// An inventory of `n` GPUs whose link between `a` and `b` (both directions) is `kind(a, b)`.
    fn machine(n: usize, kind: impl Fn(usize, usize) -> LinkKind) -> Inventory {
        let mut links = Vec::new();
        for from in 0..n {
            for to in (0..n).filter(|&t| t != from) {
                let k = kind(from.min(to), from.max(to));
                links.push(PeerLink {
                    from,
                    to,
                    p2p_access: k != LinkKind::None,
                    native_atomics: k == LinkKind::NvLink,
                    performance_rank: 0,
                    kind: k,
                });
            }
        }
        Inventory {
            driver_version: 13000,
            gpus: (0..n).map(gpu).collect(),
            links,
        }
    }

    fn pairs(inv: &Inventory) -> Vec<(usize, usize, LinkKind)> {
        suggest_tp_pairs(inv)
            .into_iter()
            .map(|p| (p.a, p.b, p.link))
            .collect()
    }

    #[test]
    fn the_link_kind_follows_the_p2p_attributes() {
        assert_eq!(LinkKind::classify(true, true), LinkKind::NvLink);
        assert_eq!(LinkKind::classify(true, false), LinkKind::Pcie);
        assert_eq!(LinkKind::classify(false, true), LinkKind::None);
        assert_eq!(LinkKind::classify(false, false), LinkKind::None);
    }

    #[test]
    fn nvlink_pairs_are_chosen_over_pcie_neighbours() {
        // 4 GPUs on one PCIe switch; NVLink bridges join 0–2 and 1–3.
        let inv = machine(4, |a, b| match (a, b) {
            (0, 2) | (1, 3) => LinkKind::NvLink,
            _ => LinkKind::Pcie,
        });
        assert_eq!(
            pairs(&inv),
            vec![(0, 2, LinkKind::NvLink), (1, 3, LinkKind::NvLink)]
        );
    }

    #[test]
    fn pcie_pairs_fill_in_after_nvlink_and_isolated_gpus_are_left_out() {
        // 0–1 NVLink; 2–3 PCIe P2P; 4 reaches nobody.
        let inv = machine(5, |a, b| match (a, b) {
            (0, 1) => LinkKind::NvLink,
            (2, 3) => LinkKind::Pcie,
            _ => LinkKind::None,
        });
        assert_eq!(
            pairs(&inv),
            vec![(0, 1, LinkKind::NvLink), (2, 3, LinkKind::Pcie)]
        );
    }

    #[test]
    fn an_nvswitch_machine_pairs_neighbours_in_order() {
        let inv = machine(8, |_, _| LinkKind::NvLink);
        let got: Vec<(usize, usize)> = pairs(&inv).into_iter().map(|(a, b, _)| (a, b)).collect();
        assert_eq!(got, vec![(0, 1), (2, 3), (4, 5), (6, 7)]);
    }

    #[test]
    fn a_one_way_link_counts_as_its_weaker_direction() {
        let mut inv = machine(2, |_, _| LinkKind::NvLink);
        let back = inv
            .links
            .iter_mut()
            .find(|l| l.from == 1 && l.to == 0)
            .expect("link 1→0");
        back.kind = LinkKind::Pcie;
        assert_eq!(pairs(&inv), vec![(0, 1, LinkKind::Pcie)]);
        inv.links.retain(|l| l.from == 0);
        assert_eq!(
            pairs(&inv),
            vec![],
            "a direction the driver did not report is no link"
        );
    }

    #[test]
    fn no_gpus_or_one_gpu_give_no_pairs() {
        assert!(suggest_tp_pairs(&Inventory::default()).is_empty());
        assert!(suggest_tp_pairs(&machine(1, |_, _| LinkKind::NvLink)).is_empty());
    }

    /// On a machine without the NVIDIA driver (this crate's CI) the inventory is a clear error,
    /// not a panic; with a driver it lists every pair of GPUs once per direction.
    #[test]
    fn inspect_reports_a_missing_driver_as_an_error() {
        // SAFETY: only tries to dlopen libcuda.
        let present = unsafe { sys::is_culib_present() };
        match inspect() {
            Err(InventoryError::NoDriver { looked }) => {
                assert!(!present);
                let message = InventoryError::NoDriver { looked }.to_string();
                assert!(message.starts_with("no NVIDIA driver found"), "{message}");
                assert!(message.ends_with(": 0 GPUs"), "{message}");
            }
            Err(other) => assert!(present, "unexpected error: {other}"),
            Ok(inv) => {
                let n = inv.gpus.len();
                assert!(present && inv.links.len() == n * n.saturating_sub(1));
            }
        }
    }
}
