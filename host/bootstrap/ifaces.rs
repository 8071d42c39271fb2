//! Network interface choice for the bootstrap's listeners (NCCL's `ncclFindInterfaces`,
//! `findInterfaces`, `matchIfList` and `ncclFindInterfaceMatchSubnet` in `src/misc/socket.cc`
//! and `src/misc/utils.cc`).
//!
//! `NCCL_SOCKET_IFNAME` syntax, as in NCCL: a comma list of interface-name prefixes (`eth,ib`);
//! a leading `=` makes the names exact (`=eth0`); a leading `^` excludes the listed names
//! instead (`^docker,lo`), and `^=` excludes exact names.
use crate::error::{Error, Result};
use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

/// One address of one network interface (an entry of `getifaddrs(3)`), IPv4 or IPv6.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Interface {
    /// Interface name, e.g. `eth0`.
    pub name: String,
    /// The interface's address.
    pub addr: IpAddr,
    /// The address's netmask, when the system reports one.
    pub netmask: Option<IpAddr>,
    /// IPv6 scope id (interface index for link-local addresses); 0 for IPv4.
    pub scope_id: u32,
    /// `IFF_UP`: the interface is administratively up.
    pub up: bool,
    /// `IFF_LOOPBACK`.
    pub loopback: bool,
}

impl Interface {
    /// The socket address `addr:port` on this interface (with the IPv6 scope id).
    pub fn socket_addr(&self, port: u16) -> SocketAddr {
        match self.addr {
            IpAddr::V4(a) => SocketAddr::from((a, port)),
            IpAddr::V6(a) => SocketAddr::V6(SocketAddrV6::new(a, port, 0, self.scope_id)),
        }
    }

    /// Whether `other` is in this interface's subnet (NCCL's `matchSubnet`).
    pub fn same_subnet(&self, other: &IpAddr) -> bool {
        match (self.addr, self.netmask, other) {
            (IpAddr::V4(a), Some(IpAddr::V4(m)), IpAddr::V4(o)) => {
                let m = u32::from(m);
                u32::from(a) & m == u32::from(*o) & m
            }
            (IpAddr::V6(a), Some(IpAddr::V6(m)), IpAddr::V6(o)) => {
                let m = u128::from(m);
                u128::from(a) & m == u128::from(*o) & m
            }
            _ => false,
        }
    }
}

/// Every IPv4/IPv6 address of every interface, in `getifaddrs(3)` order. IPv6 loopback (`::1`)
/// is left out, as NCCL does.
pub fn list_interfaces() -> Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: `head` is a valid out-pointer; on success getifaddrs stores a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::System(format!(
            "bootstrap: getifaddrs: {}",
            std::io::Error::last_os_error()
        )));
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a non-null node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        // SAFETY: the address and netmask pointers are null or point to sockaddr structs of the
        // family they announce, valid until freeifaddrs.
        let Some((addr, scope_id)) = (unsafe { sockaddr_ip(ifa.ifa_addr) }) else {
            continue;
        };
        // SAFETY: as above.
        let netmask = unsafe { sockaddr_ip(ifa.ifa_netmask) }.map(|(m, _)| m);
        if ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a non-null ifa_name is a NUL-terminated string valid until freeifaddrs.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        if addr == IpAddr::V6(Ipv6Addr::LOCALHOST) {
            continue;
        }
        out.push(Interface {
            name,
            addr,
            netmask,
            scope_id,
            up: ifa.ifa_flags & libc::IFF_UP as libc::c_uint != 0,
            loopback: ifa.ifa_flags & libc::IFF_LOOPBACK as libc::c_uint != 0,
        });
    }
    // SAFETY: `head` came from a successful getifaddrs and is freed exactly once; no reference
    // into the list outlives this point (names and addresses were copied).
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

/// The IP address (and IPv6 scope id) in a `sockaddr`, for AF_INET and AF_INET6 only.
///
/// # Safety
/// `sa` must be null or point to a valid sockaddr whose real size matches its `sa_family`.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<(IpAddr, u32)> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: `sa` is non-null and valid per the contract; sa_family is its first field.
    let family = unsafe { (*sa).sa_family } as libc::c_int;
    match family {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in; read_unaligned avoids assuming its
            // alignment.
            let sin = unsafe { std::ptr::read_unaligned(sa as *const libc::sockaddr_in) };
            Some((IpAddr::V4(Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr))), 0))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6.
            let sin6 = unsafe { std::ptr::read_unaligned(sa as *const libc::sockaddr_in6) };
            Some((
                IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)),
                sin6.sin6_scope_id,
            ))
        }
        _ => None,
    }
}

/// A parsed `NCCL_SOCKET_IFNAME` value (NCCL's `parseStringList` + `searchNot`/`searchExact`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IfFilter {
    /// `^`: the list names interfaces to leave out.
    pub exclude: bool,
    /// `=`: names match exactly instead of by prefix.
    pub exact: bool,
    /// The listed names (or prefixes); empty entries are dropped.
    pub names: Vec<String>,
}

impl IfFilter {
    /// Parses `[^][=]name[,name...]`.
    pub fn parse(spec: &str) -> IfFilter {
        let mut s = spec.trim();
        let exclude = s.starts_with('^');
        if exclude {
            s = &s[1..];
        }
        let exact = s.starts_with('=');
        if exact {
            s = &s[1..];
        }
        let names = s
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(String::from)
            .collect();
        IfFilter {
            exclude,
            exact,
            names,
        }
    }

    /// Whether interface `name` passes the filter (NCCL's `matchIfList(...) ^ searchNot`).
    pub fn matches(&self, name: &str) -> bool {
        let listed = self.names.iter().any(|n| {
            if self.exact {
                name == n
            } else {
                name.starts_with(n.as_str())
            }
        });
        listed != self.exclude
    }
}

/// Picks the interface whose address the bootstrap listens on, from `ifs` (what
/// [`list_interfaces`] returned). Only interfaces that are up count.
///
/// - `ifname = Some((variable, value))`: the first interface the filter accepts, or
///   [`Error::InvalidUsage`] naming the variable, its value and "no matching interface".
/// - otherwise, in order (NCCL's defaults): an interface in the same subnet as `near` (the root's
///   address, when known: NCCL does this for `NCCL_COMM_ID`), then `ib*`, then anything but
///   `docker*` and loopback, then `docker*`, then loopback.
pub fn select(ifs: &[Interface], ifname: Option<(&str, &str)>, near: Option<IpAddr>) -> Result<Interface> {
    let up: Vec<&Interface> = ifs.iter().filter(|i| i.up).collect();
    let found = if let Some((var, value)) = ifname {
        let f = IfFilter::parse(value);
        match up.iter().find(|i| f.matches(&i.name)) {
            Some(i) => (*i).clone(),
            None => {
                let avail: Vec<String> = up.iter().map(|i| format!("{} ({})", i.name, i.addr)).collect();
                return Err(Error::InvalidUsage(format!(
                    "bootstrap: {var}={value:?}: no matching interface among the interfaces that are up with an \
                     IPv4/IPv6 address: {}",
                    if avail.is_empty() {
                        "none".to_string()
                    } else {
                        avail.join(", ")
                    }
                )));
            }
        }
    } else {
        let docker = |i: &&&Interface| i.name.starts_with("docker");
        let lo = |i: &&&Interface| i.loopback || i.name.starts_with("lo");
        let pick = near
            .and_then(|n| up.iter().find(|i| i.same_subnet(&n)))
            .or_else(|| up.iter().find(|i| i.name.starts_with("ib")))
            .or_else(|| up.iter().find(|i| !docker(i) && !lo(i)))
            .or_else(|| up.iter().find(docker))
            .or_else(|| up.iter().find(lo));
        match pick {
            Some(i) => (*i).clone(),
            None => {
                return Err(Error::InvalidUsage(
                    "bootstrap: no socket interface found (no interface is up with an IPv4/IPv6 address)"
                        .into(),
                ));
            }
        }
    };
    tracing::debug!(target: "oxccl::bootstrap", name = %found.name, addr = %found.addr, "bootstrap interface");
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, addr: &str, mask: &str, up: bool) -> Interface {
        Interface {
            name: name.into(),
            addr: addr.parse().unwrap(),
            netmask: Some(mask.parse().unwrap()),
            scope_id: 0,
            up,
            loopback: name == "lo",
        }
    }

    fn machine() -> Vec<Interface> {
        vec![
            iface("lo", "127.0.0.1", "255.0.0.0", true),
            iface("docker0", "172.17.0.1", "255.255.0.0", true),
            iface("eth0", "10.0.0.5", "255.255.255.0", true),
            iface("eth1", "10.1.0.5", "255.255.255.0", false),
            iface("ib0", "10.2.0.5", "255.255.255.0", true),
            iface("eth2", "fd00::2", "ffff:ffff:ffff:ffff::", true),
        ]
    }

    fn pick(spec: Option<&str>, near: Option<&str>) -> Result<String> {
        select(
            &machine(),
            spec.map(|s| ("NCCL_SOCKET_IFNAME", s)),
            near.map(|n| n.parse().unwrap()),
        )
        .map(|i| i.name)
    }

    #[test]
    fn filter_syntax() {
        let f = IfFilter::parse("^=eth0, lo,");
        assert_eq!(
            f,
            IfFilter {
                exclude: true,
                exact: true,
                names: vec!["eth0".into(), "lo".into()]
            }
        );
        assert!(IfFilter::parse("eth").matches("eth0"));
        assert!(!IfFilter::parse("=eth").matches("eth0"));
        assert!(IfFilter::parse("=eth0").matches("eth0"));
        assert!(!IfFilter::parse("^eth").matches("eth0"));
        assert!(IfFilter::parse("^eth").matches("ib0"));
        assert!(IfFilter::parse("^=eth").matches("eth0"));
    }

    #[test]
    fn user_lists() {
        assert_eq!(pick(Some("eth"), None).unwrap(), "eth0");
        assert_eq!(pick(Some("=eth2"), None).unwrap(), "eth2");
        // eth1 is down: skipped even when named.
        assert_eq!(pick(Some("eth1,ib"), None).unwrap(), "ib0");
        assert_eq!(pick(Some("^lo,docker"), None).unwrap(), "eth0");
        assert_eq!(pick(Some("^=lo"), None).unwrap(), "docker0");
        assert_eq!(pick(Some("^=lo,docker0"), None).unwrap(), "eth0");
        for bad in ["nosuchif0", "=nosuchif0", "^lo,docker,eth,ib", "=eth"] {
            let e = pick(Some(bad), None).unwrap_err();
            let m = e.to_string();
            assert_eq!(e.code(), crate::ResultCode::InvalidUsage, "{m}");
            assert!(
                m.contains("NCCL_SOCKET_IFNAME") && m.contains(bad) && m.contains("no matching interface"),
                "{m}"
            );
        }
    }

    #[test]
    fn defaults_follow_nccl_order() {
        assert_eq!(pick(None, None).unwrap(), "ib0");
        assert_eq!(pick(None, Some("10.0.0.77")).unwrap(), "eth0");
        assert_eq!(pick(None, Some("127.0.0.1")).unwrap(), "lo");
        assert_eq!(pick(None, Some("fd00::9")).unwrap(), "eth2");
        let no_ib: Vec<_> = machine().into_iter().filter(|i| i.name != "ib0").collect();
        assert_eq!(select(&no_ib, None, None).unwrap().name, "eth0");
        let only: Vec<_> = machine()
            .into_iter()
            .filter(|i| i.name == "lo" || i.name == "docker0")
            .collect();
        assert_eq!(select(&only, None, None).unwrap().name, "docker0");
        let lo: Vec<_> = machine().into_iter().filter(|i| i.name == "lo").collect();
        assert_eq!(select(&lo, None, None).unwrap().name, "lo");
        let down: Vec<_> = machine()
            .into_iter()
            .map(|i| Interface { up: false, ..i })
            .collect();
        assert_eq!(
            select(&down, None, None).unwrap_err().code(),
            crate::ResultCode::InvalidUsage
        );
    }

    #[test]
    fn this_machine_has_loopback() {
        let ifs = list_interfaces().unwrap();
        let lo = select(&ifs, Some(("NCCL_SOCKET_IFNAME", "=lo")), None).unwrap();
        assert_eq!(lo.addr, IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(lo.same_subnet(&"127.0.0.1".parse().unwrap()));
    }
}
