//! `oxccl topo`: a topology's nodes and links, GPU paths, bandwidths and searched rings.
use super::*;

#[derive(clap::Args)]
pub(super) struct TopoArgs {
    /// NCCL-format topology XML to load (default: NCCL_TOPO_FILE, else this machine as detected
    /// from NVML and sysfs: every GPU NVML lists, ranks in NVML order).
    #[arg(long, value_name = "FILE")]
    topo_file: Option<std::path::PathBuf>,
    /// Write the topology back as NCCL-format XML to this file (for a detected machine: what
    /// NCCL_TOPO_DUMP_FILE would hold).
    #[arg(long, value_name = "FILE")]
    dump: Option<std::path::PathBuf>,
    /// Simulate a job over this many identical nodes (ranks of node k offset by k × GPUs per
    /// node): the search then goes through the file's NETs and the trees join the nodes.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=4096))]
    nodes: u32,
}

pub(super) fn topo(t: TopoArgs) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let system = match &t.topo_file {
        Some(path) => oxccl::topo::System::from_xml_file(path)?,
        None => match oxccl::topo::System::from_env()? {
            Some(s) => s,
            None => {
                println!(
                    "# detected from NVML and sysfs (pass --topo-file FILE or set NCCL_TOPO_FILE to load one)"
                );
                oxccl::topo::detect::detect_system()?
            }
        },
    };
    print!("{}", system.describe());
    if let Some(path) = &t.dump {
        std::fs::write(path, system.to_xml_string())
            .map_err(|e| format!("--dump {}: {e}", path.display()))?;
        println!("# wrote {}", path.display());
    }
    if system.count(oxccl::topo::NodeType::Gpu) == 0 {
        println!("\n# no GPU in this topology: no ring or tree to search");
        return Ok(ExitCode::SUCCESS);
    }
    print_graphs(&system, t.nodes as usize)?;
    Ok(ExitCode::SUCCESS)
}

/// The ring and tree graphs the search builds for `nodes` copies of `system`, and the trees of
/// channel 0 (for every rank: parent and children in tree 0 and tree 1).
pub(super) fn print_graphs(system: &oxccl::topo::System, nodes: usize) -> Result<(), Box<dyn std::error::Error>> {
    use oxccl::graph::{GraphRequest, double_binary_tree, search_graph, search_trees};
    let inter = nodes > 1 && system.count(oxccl::topo::NodeType::Net) > 0;
    if nodes > 1 && !inter {
        println!("\n# the file has no NET: each node's channels stay within it");
    }
    let print_graph = |what: &str, g: &oxccl::graph::Graph| {
        println!(
            "\n{what} graph ({}): {} channels at {} GB/s intra / {} GB/s inter, paths up to {} / {}",
            g.pattern, g.nchannels, g.speed_intra, g.speed_inter, g.type_intra, g.type_inter
        );
        for (c, order) in g.intra.iter().enumerate() {
            let mut parts: Vec<String> = order.iter().map(|r| r.to_string()).collect();
            if let Some([a, b]) = g.inter.get(c) {
                parts.insert(0, format!("NET/{a}"));
                parts.push(format!("NET/{b}"));
            } else if g.pattern == oxccl::graph::Pattern::Ring {
                parts.push(order.first().map_or(String::new(), |r| r.to_string()));
            }
            println!("  channel {c:2}: {}", parts.join(" -> "));
        }
    };
    let ring = search_graph(system, &GraphRequest::ring(inter))?;
    print_graph("Ring", &ring);
    let tree = search_trees(system, ring.nchannels, inter)?;
    print_graph("Tree", &tree);
    let ngpus = tree.intra.first().map_or(0, Vec::len);
    let base = tree
        .intra
        .first()
        .and_then(|c| c.iter().min().copied())
        .unwrap_or(0);
    let chains: Vec<Vec<usize>> = (0..nodes)
        .map(|k| tree.intra[0].iter().map(|&r| k * ngpus + r - base).collect())
        .collect();
    let [t0, t1] = double_binary_tree(&chains, tree.pattern)?;
    println!(
        "\nTrees of channel 0 over {nodes} node(s) (channel {} runs tree 1): rank: parent -> [children]",
        tree.nchannels
    );
    let fmt = |t: &oxccl::graph::Tree| {
        let down: Vec<String> = t.children().map(|d| d.to_string()).collect();
        format!("{:>3} -> [{}]", t.up, down.join(","))
    };
    for r in 0..t0.len() {
        println!("  rank {r:3}: tree 0 {:<16} tree 1 {}", fmt(&t0[r]), fmt(&t1[r]));
    }
    Ok(())
}
