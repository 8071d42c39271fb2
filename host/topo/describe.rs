//! Text description of a [`System`]: node trees with links (NCCL's `ncclTopoPrint`) and the
//! path matrix of GPUs and NICs in the style of `nvidia-smi topo -m`.
use super::paths::PathType;
use super::system::{LinkType, NodeId, NodeKind, NodeType, System, nvlink_bw};
use std::fmt::Write as _;

/// The text of [`System::describe`].
pub(crate) fn describe(sys: &System) -> String {
    let mut out = String::new();
    let counts: Vec<String> = NodeType::ALL
        .iter()
        .map(|&t| format!("{} {t}", sys.count(t)))
        .collect();
    let _ = writeln!(out, "Topology {}: {}", sys.xml.source, counts.join(", "));
    let mut seen = vec![false; sys.nodes.len()];
    for cpu in sys.ids(NodeType::Cpu) {
        print_rec(sys, cpu, None, 0, &mut seen, &mut out);
    }
    // Nodes not under any CPU (a file without <cpu> elements has none; NVS is printed here).
    for (i, _) in sys.nodes.iter().enumerate() {
        if !seen[i] && sys.nodes[i].node_type() != NodeType::Net {
            print_rec(sys, NodeId(i), None, 0, &mut seen, &mut out);
        }
    }
    out.push('\n');
    matrix(sys, &mut out);
    let mut trimmed = String::with_capacity(out.len());
    for line in out.lines() {
        trimmed.push_str(line.trim_end());
        trimmed.push('\n');
    }
    trimmed
}

fn node_line(sys: &System, id: NodeId) -> String {
    let n = sys.node(id);
    let bus = n
        .pci
        .as_ref()
        .map(|p| format!(" {} x{} {}", p.bus_id, p.link_width, p.link_speed))
        .unwrap_or_default();
    match &n.kind {
        NodeKind::Gpu(g) => format!(
            "GPU/{}{bus} rank {} sm{}{}",
            g.dev,
            g.rank,
            g.sm,
            if g.gdr { " gdr" } else { "" }
        ),
        NodeKind::Cpu(c) => format!(
            "CPU/{} {:?}/{:?}/{:?} cores {}",
            c.numa_id,
            c.arch,
            c.vendor,
            c.model,
            ranges(&c.cores)
        ),
        NodeKind::Net(x) => format!(
            "NET/{} {} {} GB/s port {} guid {:#x}{}",
            x.dev,
            x.name,
            bw(x.bw),
            x.port,
            x.guid,
            if x.gdr { " gdr" } else { "" }
        ),
        NodeKind::Pci => format!("PCI{bus} device {:#018x}", n.pci.as_ref().map_or(0, |p| p.device)),
        NodeKind::Nic => format!("NIC{bus}"),
        NodeKind::Nvs => "NVS/0".to_string(),
    }
}

fn print_rec(
    sys: &System,
    id: NodeId,
    up: Option<NodeId>,
    depth: usize,
    seen: &mut [bool],
    out: &mut String,
) {
    seen[id.0] = true;
    if depth == 0 {
        let _ = writeln!(out, "{}", node_line(sys, id));
    }
    let pad = "  ".repeat(depth + 1);
    for l in &sys.node(id).links {
        if Some(l.remote) == up {
            continue;
        }
        let rem = sys.node(l.remote);
        let down = l.kind == LinkType::Pci && rem.node_type() != NodeType::Cpu && !seen[l.remote.0];
        let net = l.kind == LinkType::Net && rem.node_type() == NodeType::Net;
        let text = if down || net {
            node_line(sys, l.remote)
        } else {
            rem.label()
        };
        let _ = writeln!(out, "{pad}+ {}[{}] - {text}", l.kind, bw(l.bw));
        if down || net {
            print_rec(sys, l.remote, Some(id), depth + 1, seen, out);
        }
    }
}

/// A bandwidth in GB/s with at most two decimals and no trailing zeros: `370.8`, `1.25`, `24`.
fn bw(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// CPU cores as `0-19,40-59`.
fn ranges(cores: &[u32]) -> String {
    if cores.is_empty() {
        return "-".to_string();
    }
    let mut parts = Vec::new();
    let mut start = cores[0];
    let mut prev = cores[0];
    for &c in &cores[1..] {
        if c != prev + 1 {
            parts.push(if start == prev {
                format!("{start}")
            } else {
                format!("{start}-{prev}")
            });
            start = c;
        }
        prev = c;
    }
    parts.push(if start == prev {
        format!("{start}")
    } else {
        format!("{start}-{prev}")
    });
    parts.join(",")
}

/// The cell of the `nvidia-smi topo -m` style matrix for the path `from` -> `to`.
pub(crate) fn cell(sys: &System, from: NodeId, to: NodeId) -> String {
    if from == to {
        return " X ".to_string();
    }
    let Some(p) = sys.paths.get(from, to) else {
        return PathType::Dis.to_string();
    };
    match (p.kind, sys.node(from).gpu()) {
        (PathType::Nvl, Some(g)) if sys.node(to).node_type() == NodeType::Gpu => {
            format!("NV{}", (p.bw / nvlink_bw(g.sm)).round() as u64)
        }
        (k, _) => k.to_string(),
    }
}

fn matrix(sys: &System, out: &mut String) {
    let mut gpus = sys.ids(NodeType::Gpu);
    gpus.sort_by_key(|&g| sys.node(g).gpu().map_or(0, |g| g.dev));
    let mut nets = sys.ids(NodeType::Net);
    nets.sort_by_key(|&n| sys.node(n).net().map_or(0, |n| n.dev));
    let all: Vec<NodeId> = gpus.iter().chain(nets.iter()).copied().collect();
    let name = |id: NodeId| match &sys.node(id).kind {
        NodeKind::Gpu(g) => format!("GPU{}", g.dev),
        NodeKind::Net(n) => format!("NIC{}", n.dev),
        _ => sys.node(id).label(),
    };
    const W: usize = 8;
    let _ = write!(out, "{:W$}", "");
    for &c in &all {
        let _ = write!(out, "{:<W$}", name(c));
    }
    let _ = writeln!(out, "CPU Affinity    NUMA Affinity");
    for &r in &all {
        let _ = write!(out, "{:<W$}", name(r));
        for &c in &all {
            let _ = write!(out, "{:<W$}", cell(sys, r, c));
        }
        if sys.node(r).node_type() == NodeType::Gpu {
            let cpu = sys.local_cpu(r).and_then(|c| sys.node(c).cpu());
            let _ = write!(
                out,
                "{:<16}{}",
                cpu.filter(|c| !c.cores.is_empty())
                    .map_or("N/A".to_string(), |c| ranges(&c.cores)),
                cpu.filter(|c| c.numa_id >= 0)
                    .map_or("N/A".to_string(), |c| c.numa_id.to_string())
            );
        }
        out.push('\n');
    }
    out.push_str(
        "\nLegend:\n\n  X    = Self\n  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)\n  PXN  = Connection to a NIC through an NVLink-connected GPU next to it (NCCL's PXN)\n  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)\n  PIX  = Connection traversing at most a single PCIe bridge\n  C2C  = Connection over the chip-to-chip link between a GPU and its CPU\n  NVB  = Connection over NVLink through one intermediate GPU\n  NV#  = Connection traversing a bonded set of # NVLinks (directly or through NVSwitches)\n",
    );
    if !nets.is_empty() {
        out.push_str("\nNIC Legend:\n\n");
        for &n in &nets {
            if let Some(x) = sys.node(n).net() {
                let _ = writeln!(out, "  NIC{}: {}", x.dev, x.name);
            }
        }
    }
    let _ = writeln!(out, "\nPath bandwidth (GB/s):\n");
    let _ = write!(out, "{:W$}", "");
    for &c in &all {
        let _ = write!(out, "{:<W$}", name(c));
    }
    out.push('\n');
    for &r in &all {
        let _ = write!(out, "{:<W$}", name(r));
        for &c in &all {
            let v = if r == c {
                " X ".to_string()
            } else {
                sys.paths
                    .get(r, c)
                    .map_or("-".to_string(), |p| format!("{:.1}", p.bw))
            };
            let _ = write!(out, "{v:<W$}");
        }
        out.push('\n');
    }
}

#[cfg(test)]
mod tests {
    use super::ranges;

    #[test]
    fn core_ranges() {
        assert_eq!(ranges(&[]), "-");
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(super::bw(370.8), "370.8");
        assert_eq!(super::bw(1.25), "1.25");
        assert_eq!(super::bw(24.0), "24");
    }
}
