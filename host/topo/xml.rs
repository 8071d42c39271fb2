//! NCCL's topology XML: the `<system version="1">` tree of `<cpu>`, `<pci>`, `<gpu>`, `<nvlink>`,
//! `<nic>` and `<net>` elements that `NCCL_TOPO_FILE` reads and `NCCL_TOPO_DUMP_FILE` writes.
//!
//! Mirrors `src/graph/xml.cc` / `xml.h`: a generic element tree (name, ordered attributes,
//! children; no text), read with `roxmltree` and written by hand in NCCL's dump layout (two-space
//! indent, one element per line, `/>` for elements without children), so a file NCCL dumped is
//! written back byte for byte. The `fill_*` functions are the merge points of detection
//! (`ncclTopoFillGpu`, `ncclTopoFillNet`): they complete a partial file without overriding what
//! it says.
use crate::error::{Error, Result};
use std::fmt::{self, Write as _};
use std::path::Path;

/// The topology XML version NCCL reads and writes (`NCCL_TOPO_XML_VERSION`).
pub const TOPO_XML_VERSION: &str = "1";

/// One XML element (NCCL's `ncclXmlNode`): its tag, attributes in file order, and children.
///
/// Equality compares names, attributes (in order) and children; `line` is where the element
/// started in its source (1-based; 0 for an element built in memory) and is not compared.
#[derive(Clone, Debug, Default)]
pub struct XmlNode {
    /// The tag name (`system`, `cpu`, `pci`, `gpu`, `nvlink`, `nic`, `net`, ...).
    pub name: String,
    /// `(key, value)` pairs in file order, values unescaped.
    pub attrs: Vec<(String, String)>,
    /// Child elements in file order.
    pub subs: Vec<XmlNode>,
    /// 1-based line of the element's start tag in its source; 0 when built in memory.
    pub line: u32,
}

impl PartialEq for XmlNode {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name && self.attrs == other.attrs && self.subs == other.subs
    }
}

impl XmlNode {
    /// A new element without attributes or children (NCCL's `xmlAddNode`).
    pub fn new(name: &str) -> Self {
        XmlNode {
            name: name.to_string(),
            ..Default::default()
        }
    }

    /// The value of attribute `key` (NCCL's `xmlGetAttr`).
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }

    /// Sets attribute `key`, replacing its value or appending it (NCCL's `xmlSetAttr`).
    pub fn set_attr(&mut self, key: &str, value: impl fmt::Display) {
        let value = value.to_string();
        match self.attrs.iter_mut().find(|(k, _)| k == key) {
            Some((_, v)) => *v = value,
            None => self.attrs.push((key.to_string(), value)),
        }
    }

    /// Sets attribute `key` only when the element does not have it yet (NCCL's `xmlInitAttr*`:
    /// what a topology file says wins over detection).
    pub fn init_attr(&mut self, key: &str, value: impl fmt::Display) {
        if self.attr(key).is_none() {
            self.attrs.push((key.to_string(), value.to_string()));
        }
    }

    /// The first child named `name` (NCCL's `xmlGetSub`).
    pub fn sub(&self, name: &str) -> Option<&XmlNode> {
        self.subs.iter().find(|s| s.name == name)
    }

    /// Every child named `name`.
    pub fn subs_named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a XmlNode> + 'a {
        self.subs.iter().filter(move |s| s.name == name)
    }

    /// Appends a child and returns it.
    pub fn add_sub(&mut self, node: XmlNode) -> &mut XmlNode {
        self.subs.push(node);
        let last = self.subs.len() - 1;
        &mut self.subs[last]
    }

    /// The first element in this subtree (this one included, depth first) for which `pred` holds.
    pub fn find(&self, pred: &dyn Fn(&XmlNode) -> bool) -> Option<&XmlNode> {
        if pred(self) {
            return Some(self);
        }
        self.subs.iter().find_map(|s| s.find(pred))
    }

    /// As [`XmlNode::find`], mutable.
    pub fn find_mut(&mut self, pred: &dyn Fn(&XmlNode) -> bool) -> Option<&mut XmlNode> {
        if pred(self) {
            return Some(self);
        }
        self.subs.iter_mut().find_map(|s| s.find_mut(pred))
    }

    /// Number of elements in this subtree, this one included.
    pub fn count(&self) -> usize {
        1 + self.subs.iter().map(XmlNode::count).sum::<usize>()
    }

    fn write(&self, indent: usize, out: &mut String) {
        // Layout of NCCL's ncclTopoDumpXmlRec.
        let _ = write!(out, "{:indent$}<{}", "", self.name);
        for (k, v) in &self.attrs {
            let _ = write!(out, " {k}=\"{}\"", escape(v));
        }
        if self.subs.is_empty() {
            out.push_str("/>\n");
        } else {
            out.push_str(">\n");
            for s in &self.subs {
                s.write(indent + 2, out);
            }
            let _ = writeln!(out, "{:indent$}</{}>", "", self.name);
        }
    }
}

fn escape(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['&', '<', '>', '"']) {
        return v.into();
    }
    let mut s = String::with_capacity(v.len() + 8);
    for c in v.chars() {
        match c {
            '&' => s.push_str("&amp;"),
            '<' => s.push_str("&lt;"),
            '>' => s.push_str("&gt;"),
            '"' => s.push_str("&quot;"),
            c => s.push(c),
        }
    }
    s.into()
}

/// A parsed topology XML document (NCCL's `ncclXml`): the root element and the name of the
/// source it came from, used in error messages as `source:line`.
#[derive(Clone, Debug, PartialEq)]
pub struct Xml {
    /// The root element (`<system>` for a topology, `<graphs>` for a graph dump).
    pub root: XmlNode,
    /// File name (or a description such as `<string>`) the document was read from.
    pub source: String,
}

/// What detection knows about one GPU: the `<gpu>` element that [`Xml::fill_gpu`] adds under the
/// GPU's `<pci>` element (NCCL's `ncclTopoFillGpu` / `ncclTopoGetXmlFromGpu`).
#[derive(Clone, Debug, PartialEq)]
pub struct GpuFill {
    /// CUDA device index (`dev`).
    pub dev: i32,
    /// Rank of the communicator using this GPU (`rank`).
    pub rank: i32,
    /// Compute capability × 10, e.g. 90 for H100/H200 (`sm`).
    pub sm: u32,
    /// Whether GPU Direct RDMA is supported (`gdr`).
    pub gdr: bool,
    /// NVLinks of the GPU, added only when the element has no `<nvlink>` children yet.
    pub nvlinks: Vec<NvLinkFill>,
}

/// One `<nvlink>` element: `count` links from a GPU to `target`.
#[derive(Clone, Debug, PartialEq)]
pub struct NvLinkFill {
    /// Bus id of the remote end (a GPU, or `fffffff:ff:ff.0` for NVSwitches collapsed into one).
    pub target: String,
    /// Number of NVLinks to that target.
    pub count: u32,
    /// PCI class of the remote end: `0x030200` GPU, `0x068000` NVSwitch, `0x068001` CPU.
    pub tclass: String,
}

impl NvLinkFill {
    /// Bus id NCCL gives all NVSwitches once collapsed into one NVS node.
    pub const NVSWITCH_TARGET: &'static str = "fffffff:ff:ff.0";
    /// PCI class of an NVSwitch (`0x068000`).
    pub const NVSWITCH_CLASS: &'static str = "0x068000";

    /// `count` links to the (collapsed) NVSwitch, as NCCL records GPUs of an NVSwitch system.
    pub fn nvswitch(count: u32) -> Self {
        NvLinkFill {
            target: Self::NVSWITCH_TARGET.to_string(),
            count,
            tclass: Self::NVSWITCH_CLASS.to_string(),
        }
    }

    /// `count` direct links to the GPU at bus id `target`.
    pub fn gpu(target: &str, count: u32) -> Self {
        NvLinkFill {
            target: target.to_string(),
            count,
            tclass: "0x030200".to_string(),
        }
    }
}

/// What the network plugin knows about one network device: the `<net>` element that
/// [`Xml::fill_net`] adds in a `<nic>` under the NIC's `<pci>` element (NCCL's `ncclTopoFillNet`).
#[derive(Clone, Debug, PartialEq)]
pub struct NetFill {
    /// Device name, e.g. `mlx5_0` (`name`, the key of the element).
    pub name: String,
    /// Network device index (`dev`).
    pub dev: i32,
    /// Port speed in Mb/s, e.g. 200000 for HDR InfiniBand (`speed`).
    pub speed_mbps: u64,
    /// Port number (`port`).
    pub port: u32,
    /// Unique id of the ASIC (`guid`); ports of one ASIC share it.
    pub guid: u64,
    /// Whether GPU Direct RDMA is supported (`gdr`).
    pub gdr: bool,
    /// Maximum connections (`maxconn`).
    pub maxconn: u32,
}

impl Xml {
    /// Parses NCCL topology XML text; `source` names it in errors. A malformed document is an
    /// `InvalidArgument` error reading `source:line: reason` (NCCL's `ncclTopoGetXmlFromFile`).
    pub fn parse(text: &str, source: &str) -> Result<Xml> {
        let opts = roxmltree::ParsingOptions {
            allow_dtd: false,
            ..Default::default()
        };
        let doc = roxmltree::Document::parse_with_options(text, opts).map_err(|e| {
            use roxmltree::Error as E;
            let (line, why) = match e {
                E::UnexpectedEndOfStream | E::UnclosedRootNode => (
                    text.lines().count().max(1) as u32,
                    format!("unexpected end of file, an element is not closed (truncated?): {e}"),
                ),
                E::NoRootNode => (1, "no root element (empty file?)".to_string()),
                _ => (e.pos().row, e.to_string()),
            };
            Error::invalid(format!("{source}:{line}: malformed topology XML: {why}"))
        })?;
        let root = convert(&doc, doc.root_element(), source)?;
        tracing::debug!(target: "oxccl::graph", source, elements = root.count(), root = %root.name, "topology XML parsed");
        Ok(Xml {
            root,
            source: source.to_string(),
        })
    }

    /// Reads and parses a topology file (`NCCL_TOPO_FILE`). A missing or unreadable file is a
    /// `System` error naming it; a malformed one an `InvalidArgument` error with file and line.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Xml> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::System(format!("cannot read topology file {}: {e}", path.display())))?;
        Xml::parse(&text, &path.display().to_string())
    }

    /// The topology file named by `NCCL_TOPO_FILE` / `OXCCL_TOPO_FILE`, parsed; `None` when the
    /// variable is not set.
    pub fn from_env() -> Result<Option<Xml>> {
        match crate::params::env_var("TOPO_FILE") {
            None => Ok(None),
            Some((key, path)) => {
                tracing::info!(target: "oxccl::graph", "{key} set: loading topology from {path}");
                Xml::from_file(&path).map(Some)
            }
        }
    }

    /// An empty `<system version="1">` document.
    pub fn new_system() -> Xml {
        let mut root = XmlNode::new("system");
        root.set_attr("version", TOPO_XML_VERSION);
        Xml {
            root,
            source: "<memory>".to_string(),
        }
    }

    /// The document in NCCL's `NCCL_TOPO_DUMP_FILE` layout (`ncclTopoDumpXmlToFile`).
    pub fn to_xml_string(&self) -> String {
        let mut out = String::new();
        self.root.write(0, &mut out);
        out
    }

    /// Writes the document to `path` in NCCL's dump layout.
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_xml_string())
            .map_err(|e| Error::System(format!("cannot write topology file {}: {e}", path.display())))
    }

    /// Writes the document to the file named by `NCCL_TOPO_DUMP_FILE` / `OXCCL_TOPO_DUMP_FILE`;
    /// returns the path written, `None` when the variable is not set.
    pub fn dump_to_env_file(&self) -> Result<Option<String>> {
        match crate::params::env_var("TOPO_DUMP_FILE") {
            None => Ok(None),
            Some((key, path)) => {
                tracing::info!(target: "oxccl::graph", "{key} set: dumping topology to {path}");
                self.write_file(&path)?;
                Ok(Some(path))
            }
        }
    }

    /// The `<pci>` element with bus id `bus_id` (compared as numbers, so `0000:07:00.0` and
    /// `00000000:07:00.0` match, like NCCL's `busIdToInt64`).
    pub fn find_pci(&self, bus_id: &str) -> Option<&XmlNode> {
        let want = bus_id_to_int(bus_id)?;
        self.root
            .find(&|n: &XmlNode| n.name == "pci" && n.attr("busid").and_then(bus_id_to_int) == Some(want))
    }

    fn find_pci_mut(&mut self, bus_id: &str) -> Result<&mut XmlNode> {
        let want =
            bus_id_to_int(bus_id).ok_or_else(|| Error::invalid(format!("{bus_id:?} is not a PCI bus id")))?;
        let source = self.source.clone();
        self.root
            .find_mut(&|n: &XmlNode| n.name == "pci" && n.attr("busid").and_then(bus_id_to_int) == Some(want))
            .ok_or_else(|| Error::invalid(format!("{source}: no <pci busid=\"{bus_id}\"> in the topology")))
    }

    /// Merges what detection knows about the GPU at `bus_id` into the document (NCCL's
    /// `ncclTopoFillGpu`): finds or creates its `<gpu>` element, sets `dev`, `sm`, `rank` and
    /// `gdr` where the file does not already say, and adds the NVLinks when the file lists none.
    /// The `<pci>` element must exist (a partial file lists the PCI tree; detection of the tree
    /// itself from sysfs is not done here).
    pub fn fill_gpu(&mut self, bus_id: &str, gpu: &GpuFill) -> Result<()> {
        let pci = self.find_pci_mut(bus_id)?;
        if pci.sub("gpu").is_none() {
            pci.add_sub(XmlNode::new("gpu"));
        }
        let Some(node) = pci.subs.iter_mut().find(|s| s.name == "gpu") else {
            return Err(Error::Internal(format!("<gpu> of {bus_id} vanished")));
        };
        node.init_attr("dev", gpu.dev);
        node.init_attr("sm", gpu.sm);
        node.init_attr("rank", gpu.rank);
        node.init_attr("gdr", u8::from(gpu.gdr));
        if node.sub("nvlink").is_none() {
            for l in &gpu.nvlinks {
                let link = node.add_sub(XmlNode::new("nvlink"));
                link.set_attr("target", &l.target);
                link.set_attr("count", l.count);
                link.set_attr("tclass", &l.tclass);
            }
        }
        tracing::debug!(target: "oxccl::graph", bus_id, dev = gpu.dev, rank = gpu.rank, sm = gpu.sm, nvlinks = gpu.nvlinks.len(), "GPU filled into topology XML");
        Ok(())
    }

    /// Merges what the network plugin knows about a network device whose NIC is at `bus_id`
    /// (NCCL's `ncclTopoFillNet`): finds or creates the `<nic>` under the `<pci>` element and the
    /// `<net name=...>` in it, and sets the attributes the file does not already give.
    pub fn fill_net(&mut self, bus_id: &str, net: &NetFill) -> Result<()> {
        let pci = self.find_pci_mut(bus_id)?;
        if pci.sub("nic").is_none() {
            pci.add_sub(XmlNode::new("nic"));
        }
        let Some(nic) = pci.subs.iter_mut().find(|s| s.name == "nic") else {
            return Err(Error::Internal(format!("<nic> of {bus_id} vanished")));
        };
        let pos = match nic
            .subs
            .iter()
            .position(|s| s.name == "net" && s.attr("name") == Some(net.name.as_str()))
        {
            Some(p) => p,
            None => {
                let mut n = XmlNode::new("net");
                n.set_attr("name", &net.name);
                nic.subs.push(n);
                nic.subs.len() - 1
            }
        };
        let node = &mut nic.subs[pos];
        node.init_attr("dev", net.dev);
        node.init_attr("speed", net.speed_mbps);
        node.init_attr("port", net.port);
        node.init_attr("guid", format_args!("{:#x}", net.guid));
        node.init_attr("maxconn", net.maxconn);
        node.init_attr("gdr", u8::from(net.gdr));
        tracing::debug!(target: "oxccl::graph", bus_id, name = %net.name, dev = net.dev, speed_mbps = net.speed_mbps, "network device filled into topology XML");
        Ok(())
    }
}

impl fmt::Display for Xml {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_xml_string())
    }
}

/// A PCI bus id as a number, NCCL's `busIdToInt64`: the hex digits with `:` and `.` skipped, up
/// to the first other character (`0000:07:00.0` -> 0x7000). `None` when there is no hex digit.
pub fn bus_id_to_int(bus_id: &str) -> Option<i64> {
    let digits: String = bus_id
        .chars()
        .filter(|c| *c != ':' && *c != '.')
        .take_while(|c| c.is_ascii_hexdigit())
        .take(16)
        .collect();
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(&digits, 16).ok().map(|v| v as i64)
}

fn convert(doc: &roxmltree::Document<'_>, node: roxmltree::Node<'_, '_>, source: &str) -> Result<XmlNode> {
    let line = doc.text_pos_at(node.range().start).row;
    let mut out = XmlNode {
        name: node.tag_name().name().to_string(),
        attrs: node
            .attributes()
            .map(|a| (a.name().to_string(), a.value().to_string()))
            .collect(),
        subs: Vec::new(),
        line,
    };
    for child in node.children() {
        if child.is_element() {
            out.subs.push(convert(doc, child, source)?);
        } else if child.is_text() {
            let text = child.text().unwrap_or("");
            if !text.trim().is_empty() {
                let lead = text.len() - text.trim_start().len();
                let at = doc.text_pos_at(child.range().start + lead).row;
                return Err(Error::invalid(format!(
                    "{source}:{at}: malformed topology XML: unexpected text {:?} inside <{}> (elements carry attributes only)",
                    text.trim(),
                    out.name
                )));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_ids_as_numbers() {
        assert_eq!(bus_id_to_int("0000:07:00.0"), Some(0x7000));
        assert_eq!(bus_id_to_int("00000000:07:00.0"), Some(0x7000));
        assert_eq!(bus_id_to_int("0001:00:00.0"), Some(0x10_0000));
        assert_eq!(bus_id_to_int("fffffff:ff:ff.0"), Some(0xffff_ffff_fff0));
        assert_eq!(bus_id_to_int("zz"), None);
    }

    #[test]
    fn attributes_and_layout() {
        let mut x = Xml::new_system();
        let cpu = x.root.add_sub(XmlNode::new("cpu"));
        cpu.set_attr("numaid", 0);
        cpu.init_attr("numaid", 5);
        cpu.set_attr("vendor", "A&B \"x\"");
        assert_eq!(
            x.to_xml_string(),
            "<system version=\"1\">\n  <cpu numaid=\"0\" vendor=\"A&amp;B &quot;x&quot;\"/>\n</system>\n"
        );
        let back = Xml::parse(&x.to_xml_string(), "t").unwrap();
        assert_eq!(
            back,
            Xml {
                source: "t".into(),
                ..x
            }
        );
        assert_eq!(back.root.subs[0].line, 2);
    }

    #[test]
    fn text_content_is_rejected() {
        let e = Xml::parse("<system version=\"1\">\n  hello\n</system>\n", "f.xml").unwrap_err();
        assert!(
            e.to_string().contains("f.xml:2:") && e.to_string().contains("hello"),
            "{e}"
        );
    }
}
