//! `strata node inspect`: this machine's GPUs and the links between them, and the GPU pairs a
//! TP = 2 group should take (NVLink first, then PCIe peer-to-peer).

use anyhow::Result;
use clap::Subcommand;
use serde_json::{Value, json};
use strata_collective::inventory::{Inventory, InventoryError, inspect, suggest_tp_pairs};

#[derive(Subcommand)]
pub enum NodeCommand {
    /// List the GPUs (memory, compute capability, PCI bus id) and the peer link between every
    /// pair. Without an NVIDIA driver it says so and lists 0 GPUs.
    Inspect {
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(command: NodeCommand) -> Result<()> {
    match command {
        NodeCommand::Inspect { json } => inspect_node(json),
    }
}

fn inspect_node(as_json: bool) -> Result<()> {
    let inventory = match inspect() {
        Ok(inventory) => inventory,
        // No driver is an answer, not a failure: this machine has no usable GPU.
        Err(e @ InventoryError::NoDriver { .. }) => {
            if as_json {
                let value = json!({"driver": Value::Null, "message": e.to_string(),
                                   "gpus": [], "links": [], "tp_pairs": []});
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                println!("{e}");
            }
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    if as_json {
        println!("{}", serde_json::to_string_pretty(&to_json(&inventory))?);
    } else {
        print_tables(&inventory);
    }
    Ok(())
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

fn print_tables(inv: &Inventory) {
    println!(
        "CUDA driver {}.{}: {} GPU(s)",
        inv.driver_version / 1000,
        inv.driver_version % 1000 / 10,
        inv.gpus.len()
    );
    if inv.gpus.is_empty() {
        return;
    }
    println!(
        "{:>3}  {:<28} {:>10} {:>10} {:>4}  pci_bus_id",
        "gpu", "name", "total_GiB", "free_GiB", "cc"
    );
    for g in &inv.gpus {
        let free = g
            .memory_free
            .map_or_else(|| "?".to_string(), |f| format!("{:.1}", gib(f)));
        println!(
            "{:>3}  {:<28} {:>10.1} {:>10} {:>4}  {}",
            g.index,
            g.name,
            gib(g.memory_total),
            free,
            format!("{}.{}", g.compute_capability.0, g.compute_capability.1),
            g.pci_bus_id
        );
    }
    if inv.gpus.len() > 1 {
        println!(
            "\npeer links (row → column; * = P2P access supported; link inferred from P2P attributes):"
        );
        print!("{:>6}", "");
        for g in &inv.gpus {
            print!(" {:>8}", format!("gpu{}", g.index));
        }
        println!();
        for a in &inv.gpus {
            print!("{:>6}", format!("gpu{}", a.index));
            for b in &inv.gpus {
                let cell = match inv.link(a.index, b.index) {
                    None => "-".to_string(),
                    Some(l) => format!("{}{}", l.kind, if l.p2p_access { "*" } else { "" }),
                };
                print!(" {cell:>8}");
            }
            println!();
        }
    }
    let pairs = suggest_tp_pairs(inv);
    if pairs.is_empty() {
        println!("\nsuggested TP=2 pairs: none (no two GPUs with peer access)");
    } else {
        let listed: Vec<String> = pairs
            .iter()
            .map(|p| format!("{}+{} ({})", p.a, p.b, p.link))
            .collect();
        println!("\nsuggested TP=2 pairs: {}", listed.join(", "));
    }
}

fn to_json(inv: &Inventory) -> Value {
    let gpus: Vec<Value> = inv
        .gpus
        .iter()
        .map(|g| {
            json!({"index": g.index, "name": g.name, "memory_total_bytes": g.memory_total,
                   "memory_free_bytes": g.memory_free,
                   "compute_capability": format!("{}.{}", g.compute_capability.0,
                                                 g.compute_capability.1),
                   "pci_bus_id": g.pci_bus_id})
        })
        .collect();
    let links: Vec<Value> = inv
        .links
        .iter()
        .map(|l| {
            json!({"from": l.from, "to": l.to, "link": l.kind.as_str(),
                   "p2p_access": l.p2p_access, "native_atomics": l.native_atomics,
                   "performance_rank": l.performance_rank})
        })
        .collect();
    let pairs: Vec<Value> = suggest_tp_pairs(inv)
        .iter()
        .map(|p| json!({"gpus": [p.a, p.b], "link": p.link.as_str()}))
        .collect();
    json!({"driver": inv.driver_version, "gpus": gpus, "links": links, "tp_pairs": pairs,
           "link_source": "CUDA driver P2P attributes: access + native atomics = nvlink, \
                           access alone = pcie"})
}
