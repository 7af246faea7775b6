//! Proof that the process answering on a worker's port is the worker.
//!
//! Any user on the node can bind a free port on 127.0.0.1. A health probe alone cannot tell
//! the worker from another user's process there (a squatter answers whatever it likes, and
//! then receives every caller's prompts). The kernel can: `/proc/net/tcp` and `tcp6` list each
//! listening socket with the uid that owns it. A worker is ready only when every socket
//! listening on its port belongs to the worker account; a socket of another uid there is a
//! squatter, and the load fails with a message that says so. Every worker runs as that one
//! account, so the lifecycle also asks which processes hold the sockets ([`holders`]) and
//! whether each is the worker's own (`launcher::is_its_process`).
//!
//! The kernel is asked through `NETLINK_SOCK_DIAG` for listening TCP sockets only (what
//! `ss -ltn` does): its cost does not grow with the node's connections. `/proc/net/tcp{,6}`
//! lists every socket (tens of milliseconds with ten thousand in TIME_WAIT) and is read only
//! where netlink is refused.
//!
//! This needs the worker on this node's network namespace (the `local` launcher, and Slurm
//! jobs on the agent's own node, the reference setup). A Slurm worker on another node proves
//! its port itself: the job runs [`prove_port`] (`gpuhub-agent worker-proof`) as the worker
//! account on its own node and writes the answer to a file only that account can write
//! (`launcher::slurm`'s `.proof` file); the agent sends the key only after an `ok` there.

use std::net::IpAddr;

/// Who listens on a port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortOwner {
    /// Nothing listens yet.
    Nobody,
    /// Only the expected account listens.
    Worker,
    /// A socket of another uid listens on the port.
    Other { uid: u32 },
}

/// A TCP socket in LISTEN state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listener {
    pub port: u16,
    pub uid: u32,
    /// Its local address (unspecified: every address).
    pub addr: IpAddr,
    /// An IPv6 socket that takes no IPv4 connections (`IPV6_V6ONLY`); false where unknown.
    pub v6only: bool,
    /// The socket's inode (`socket:[INODE]` in its holder's `/proc/PID/fd`).
    pub inode: u64,
}

impl Listener {
    /// Whether a connection to `target` on its port could reach this socket.
    pub fn receives(&self, target: IpAddr) -> bool {
        let (addr, target) = (self.addr.to_canonical(), target.to_canonical());
        if target.is_unspecified() || addr == target {
            return true;
        }
        match self.addr {
            IpAddr::V4(a) => a.is_unspecified() && target.is_ipv4(),
            IpAddr::V6(a) => a.is_unspecified() && (target.is_ipv6() || !self.v6only),
        }
    }
}

/// The addresses a connection to `host` goes to, when known without a name lookup: the
/// address itself, or both loopbacks for `localhost`. `None` (a host name): every address.
pub fn targets_of(host: &str) -> Option<Vec<IpAddr>> {
    if host == "localhost" {
        return Some(vec![IpAddr::from([127, 0, 0, 1]), IpAddr::from(std::net::Ipv6Addr::LOCALHOST)]);
    }
    let ip = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok()?;
    (!ip.is_unspecified()).then(|| vec![ip])
}

/// The addresses a call to `host` goes to: [`targets_of`], else the name looked up (the
/// agents look it up the same way to call it). `None` (every address) when the name does not
/// resolve, or resolves to an unspecified address.
fn addresses_of(host: &str, port: u16) -> Option<Vec<IpAddr>> {
    use std::net::ToSocketAddrs;
    if let Some(t) = targets_of(host) {
        return Some(t);
    }
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let ips: Vec<IpAddr> = (bare, port).to_socket_addrs().ok()?.map(|a| a.ip()).collect();
    (!ips.is_empty() && ips.iter().all(|ip| !ip.is_unspecified())).then_some(ips)
}

/// The sockets in LISTEN state on `port` (any local address, IPv4 and IPv6).
pub fn listeners_on(port: u16) -> std::io::Result<Vec<Listener>> {
    match netlink_listeners() {
        Ok(all) => Ok(all.into_iter().filter(|l| l.port == port).collect()),
        Err(e) => {
            tracing::debug!(error = %e, "sock_diag netlink refused; reading /proc/net/tcp");
            proc_listeners(port)
        }
    }
}

/// Every listening TCP socket (IPv4 and IPv6), from `NETLINK_SOCK_DIAG`.
pub fn netlink_listeners() -> std::io::Result<Vec<Listener>> {
    const NETLINK_SOCK_DIAG: libc::c_int = 4;
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const TCP_LISTEN: u32 = 10;
    // SAFETY: plain syscall; the descriptor is owned (and closed) by `fd` below.
    let raw = unsafe { libc::socket(libc::AF_NETLINK, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, NETLINK_SOCK_DIAG) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor nothing else owns.
    let fd = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(raw) };
    let fdr = std::os::fd::AsRawFd::as_raw_fd(&fd);
    // SAFETY: 2 s receive timeout; the option value is a valid timeval.
    let tv = libc::timeval { tv_sec: 2, tv_usec: 0 };
    unsafe {
        libc::setsockopt(
            fdr,
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as u32,
        )
    };
    let mut out = Vec::new();
    for (seq, family) in [(1u32, libc::AF_INET as u8), (2u32, libc::AF_INET6 as u8)] {
        // nlmsghdr (16 bytes) + inet_diag_req_v2 (56 bytes), native endian.
        let mut req = Vec::with_capacity(72);
        req.extend_from_slice(&72u32.to_ne_bytes());
        req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        req.extend_from_slice(&((libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16).to_ne_bytes());
        req.extend_from_slice(&seq.to_ne_bytes());
        req.extend_from_slice(&0u32.to_ne_bytes());
        req.extend_from_slice(&[family, libc::IPPROTO_TCP as u8, 0, 0]);
        req.extend_from_slice(&(1u32 << TCP_LISTEN).to_ne_bytes());
        req.resize(72, 0);
        // SAFETY: a zeroed sockaddr_nl addressed to the kernel (pid 0); req is valid for its length.
        let sent = unsafe {
            let mut addr: libc::sockaddr_nl = std::mem::zeroed();
            addr.nl_family = libc::AF_NETLINK as u16;
            libc::sendto(
                fdr,
                req.as_ptr().cast(),
                req.len(),
                0,
                (&addr as *const libc::sockaddr_nl).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as u32,
            )
        };
        if sent < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut buf = vec![0u8; 64 * 1024];
        'recv: loop {
            // SAFETY: buf is valid for its length.
            let n = unsafe { libc::recv(fdr, buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
            match parse_diag(&buf[..n as usize], seq, &mut out)? {
                true => break 'recv,
                false => continue,
            }
        }
    }
    drop(fd);
    Ok(out)
}

/// Parses one datagram of a sock_diag dump into `out`; `Ok(true)` once the dump is done.
fn parse_diag(mut data: &[u8], seq: u32, out: &mut Vec<Listener>) -> std::io::Result<bool> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "malformed sock_diag answer");
    let u32_at = |b: &[u8], i: usize| b.get(i..i + 4).map(|x| u32::from_ne_bytes([x[0], x[1], x[2], x[3]]));
    while data.len() >= 16 {
        let len = u32_at(data, 0).ok_or_else(bad)? as usize;
        let kind = u16::from_ne_bytes([data[4], data[5]]);
        if len < 16 || len > data.len() {
            return Err(bad());
        }
        let body = &data[16..len];
        if u32_at(data, 8) == Some(seq) {
            match kind {
                3 => return Ok(true), // NLMSG_DONE
                2 => {
                    // NLMSG_ERROR: a negative errno, or 0 as an acknowledgement.
                    let errno = u32_at(body, 0).ok_or_else(bad)? as i32;
                    if errno != 0 {
                        return Err(std::io::Error::from_raw_os_error(-errno));
                    }
                }
                _ => {
                    // inet_diag_msg (72 bytes): family, state, timer, retrans, then
                    // inet_diag_sockid (sport big-endian, dport, src address in 16 bytes, ...),
                    // uid at byte 64, inode at 68; then attributes, INET_DIAG_SKV6ONLY among
                    // them for IPv6.
                    let port = body.get(4..6).map(|p| u16::from_be_bytes([p[0], p[1]])).ok_or_else(bad)?;
                    let uid = u32_at(body, 64).ok_or_else(bad)?;
                    let src = body.get(8..24).ok_or_else(bad)?;
                    let addr = if body[0] == libc::AF_INET6 as u8 {
                        let mut b = [0u8; 16];
                        b.copy_from_slice(src);
                        IpAddr::from(b)
                    } else {
                        IpAddr::from([src[0], src[1], src[2], src[3]])
                    };
                    let inode = u64::from(u32_at(body, 68).ok_or_else(bad)?);
                    out.push(Listener { port, uid, addr, v6only: v6only_attr(body.get(72..).unwrap_or_default()), inode });
                }
            }
        }
        data = &data[((len + 3) & !3).min(data.len())..];
    }
    Ok(false)
}

/// Whether the attributes after an `inet_diag_msg` say `INET_DIAG_SKV6ONLY` = 1.
fn v6only_attr(mut attrs: &[u8]) -> bool {
    const INET_DIAG_SKV6ONLY: u16 = 11;
    while attrs.len() >= 4 {
        let len = usize::from(u16::from_ne_bytes([attrs[0], attrs[1]]));
        let kind = u16::from_ne_bytes([attrs[2], attrs[3]]);
        if len < 4 || len > attrs.len() {
            return false;
        }
        if kind == INET_DIAG_SKV6ONLY {
            return attrs.get(4).is_some_and(|v| *v != 0);
        }
        attrs = &attrs[((len + 3) & !3).min(attrs.len())..];
    }
    false
}

/// [`listeners_on`] from `/proc/net/tcp` and `tcp6` (which do not say `IPV6_V6ONLY`).
pub fn proc_listeners(port: u16) -> std::io::Result<Vec<Listener>> {
    let mut found = Vec::new();
    let mut found_table = false;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        match std::fs::read_to_string(table) {
            Ok(text) => {
                found_table = true;
                found.extend(parse_listeners(&text, port));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if !found_table {
        return Err(std::io::Error::new(std::io::ErrorKind::NotFound, "neither /proc/net/tcp nor /proc/net/tcp6 exists"));
    }
    Ok(found)
}

/// Who listens on `port`, against the worker's `uid`: the sockets a connection to one of
/// `targets` could reach (`None`: every socket on the port). A socket of another user on
/// another address (`[::1]:P` beside a worker on `127.0.0.1:P`) never sees the worker's calls.
pub fn owner(port: u16, uid: u32, targets: Option<&[IpAddr]>) -> std::io::Result<PortOwner> {
    Ok(owner_of(&reachable(port, targets)?, uid))
}

/// Who listens, from the sockets listening on a port ([`reachable`]), for a worker of account
/// `uid`.
pub fn owner_of(listeners: &[Listener], uid: u32) -> PortOwner {
    classify(&listeners.iter().map(|l| l.uid).collect::<Vec<_>>(), uid)
}

/// The sockets listening on `port` that a connection to one of `targets` could reach.
pub fn reachable(port: u16, targets: Option<&[IpAddr]>) -> std::io::Result<Vec<Listener>> {
    Ok(listeners_on(port)?.into_iter().filter(|l| targets.is_none_or(|t| t.iter().any(|t| l.receives(*t)))).collect())
}

/// The processes of `uid` that hold one of the sockets `inodes` (found in their
/// `/proc/PID/fd`). Every worker runs as the one worker account, so the account alone cannot
/// tell two workers apart: this names the process behind a port. Empty where the descriptors
/// cannot be read (an agent without root).
pub fn holders(uid: u32, inodes: &[u64]) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt;
    let wanted: Vec<String> = inodes.iter().filter(|i| **i != 0).map(|i| format!("socket:[{i}]")).collect();
    if wanted.is_empty() {
        return Vec::new();
    }
    let Ok(procs) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut out = Vec::new();
    for e in procs.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        // `/proc/PID` belongs to the process's effective uid: other accounts' processes are
        // skipped without opening anything. (A process that made itself not dumpable shows
        // as root's and is not found: the caller then cannot tell, and says so.)
        if e.metadata().map(|m| m.uid()).ok() != Some(uid) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(e.path().join("fd")) else { continue };
        if fds.flatten().any(|fd| std::fs::read_link(fd.path()).is_ok_and(|l| wanted.iter().any(|w| l.as_os_str() == w.as_str()))) {
            out.push(pid);
        }
    }
    out
}

fn classify(uids: &[u32], uid: u32) -> PortOwner {
    if let Some(other) = uids.iter().find(|u| **u != uid) {
        PortOwner::Other { uid: *other }
    } else if uids.is_empty() {
        PortOwner::Nobody
    } else {
        PortOwner::Worker
    }
}

/// `GPUHUB_PROOF_HOST=HOST gpuhub-agent worker-proof PORT JOBID FILE SECS`, run by a Slurm
/// worker job on its own node as the worker account: waits (at most `secs`) until something
/// listens on `port`, then writes `JOBID PORT ok` to `file` when every listener there is this
/// process's uid, `JOBID PORT uid N` when another uid listens (written to `FILE.tmp` and
/// renamed). Nothing written when nothing listened in time (the agent's load timeout then fails
/// the load). `host` is what the agents call (the job's `.addr`): only the sockets a call there
/// could reach count, as on the agent's own node, so another user's socket on the node's
/// `127.0.0.1:PORT` beside a worker on the node's address neither fails the load nor sees a
/// call. Without `host`, or when it names no address here, every socket on the port counts.
pub fn prove_port(port: u16, job: &str, file: &std::path::Path, secs: u64, host: Option<&str>) -> std::io::Result<bool> {
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    let targets = host.and_then(|h| addresses_of(h, port));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let mut delay = std::time::Duration::from_millis(5);
    loop {
        let line = match owner(port, me, targets.as_deref())? {
            PortOwner::Nobody => None,
            PortOwner::Worker => Some(format!("{job} {port} ok\n")),
            PortOwner::Other { uid } => Some(format!("{job} {port} uid {uid}\n")),
        };
        if let Some(line) = line {
            let tmp = file.with_extension("proof.tmp");
            std::fs::write(&tmp, line)?;
            std::fs::rename(&tmp, file)?;
            return Ok(true);
        }
        if std::time::Instant::now() >= deadline {
            return Ok(false);
        }
        std::thread::sleep(delay);
        delay = (delay * 3 / 2).min(std::time::Duration::from_millis(200));
    }
}

/// Parses one `/proc/net/tcp{,6}` table: `sl local_address rem_address st ... uid ...`, the
/// address `HEXIP:HEXPORT` (the IP as 32-bit words in host order), state `0A` = LISTEN, uid
/// the 8th column.
pub fn parse_listeners(text: &str, port: u16) -> Vec<Listener> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (ip, p) = f.get(1)?.rsplit_once(':')?;
            let state = f.get(3)?;
            let uid = f.get(7)?.parse::<u32>().ok()?;
            let p = u16::from_str_radix(p, 16).ok()?;
            let word = |i: usize| ip.get(i * 8..i * 8 + 8).and_then(|w| u32::from_str_radix(w, 16).ok()).map(u32::to_ne_bytes);
            let addr = match ip.len() {
                8 => IpAddr::from(word(0)?),
                32 => {
                    let mut b = [0u8; 16];
                    for i in 0..4 {
                        b[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
                    }
                    IpAddr::from(b)
                }
                _ => return None,
            };
            let inode = f.get(9).and_then(|i| i.parse::<u64>().ok()).unwrap_or(0);
            (*state == "0A" && p == port).then_some(Listener { port, uid, addr, v6only: false, inode })
        })
        .collect()
}

/// `(host, port)` of a worker's `http://HOST:PORT[/...]` base URL.
pub fn host_port(base_url: &str) -> Option<(String, u16)> {
    let rest = base_url.strip_prefix("http://")?;
    let authority = rest.split('/').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    Some((host.trim_start_matches('[').trim_end_matches(']').to_string(), port.parse().ok()?))
}

/// Whether `host` is this node, so the owner of its port can be checked here: a loopback or
/// unspecified address, `localhost`, or this node's host name.
pub fn is_this_node(host: &str) -> bool {
    if let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>() {
        return ip.is_loopback() || ip.is_unspecified();
    }
    host == "localhost" || host_name().is_some_and(|h| h == host || h.split('.').next() == Some(host))
}

fn host_name() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: buf is valid for its length; gethostname NUL-terminates within it on success.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    const TCP: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:20D0 00000000:0000 0A 00000000:00000000 00:00000000 00000000   999        0 1 1 0000000000000000 100 0 0 10 0
   1: 00000000:20D0 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 2 1 0000000000000000 100 0 0 10 0
   2: 0100007F:20D0 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn a_job_proves_its_own_listener() {
        let dir = tempfile::tempdir().unwrap();
        let l = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = l.local_addr().unwrap().port();
        let file = dir.path().join("m.42.proof");
        assert!(prove_port(port, "42", &file, 5, None).unwrap());
        assert_eq!(std::fs::read_to_string(&file).unwrap(), format!("42 {port} ok\n"));
        drop(l);
        let free = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port();
        let none = dir.path().join("m.43.proof");
        assert!(!prove_port(free, "43", &none, 0, None).unwrap(), "nothing listens: no proof");
        assert!(!none.exists());
    }

    #[test]
    fn a_job_proves_only_what_a_call_to_its_address_reaches() {
        // A socket on 127.0.0.1:P (another user's, beside a worker on the node's address) is
        // not on the way of a call to 127.0.0.2:P: it is neither the worker nor a squatter.
        let dir = tempfile::tempdir().unwrap();
        let beside = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = beside.local_addr().unwrap().port();
        let file = dir.path().join("m.44.proof");
        assert!(!prove_port(port, "44", &file, 0, Some("127.0.0.2")).unwrap(), "nothing listens where the calls go");
        assert!(!file.exists());
        // SAFETY: plain syscall.
        let me = unsafe { libc::geteuid() };
        let to = [IpAddr::from([127, 0, 0, 2])];
        assert_eq!(owner(port, me.wrapping_add(1), Some(&to)).unwrap(), PortOwner::Nobody, "another uid's socket elsewhere");
        assert_eq!(owner(port, me.wrapping_add(1), None).unwrap(), PortOwner::Other { uid: me }, "counted without the address");
        let Ok(worker) = std::net::TcpListener::bind(("127.0.0.2", port)) else { return };
        assert!(prove_port(port, "44", &file, 5, Some("127.0.0.2")).unwrap());
        assert_eq!(std::fs::read_to_string(&file).unwrap(), format!("44 {port} ok\n"));
        // A name is looked up as the agents look it up; one that does not resolve: every socket.
        assert_eq!(addresses_of("localhost", port).map(|a| a.len()), Some(2));
        assert_eq!(addresses_of("no-such-host.invalid", port), None);
        assert_eq!(addresses_of("0.0.0.0", port), None);
        drop((beside, worker));
    }

    const TCP6: &str = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:20D0 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1002        0 5 1 0000000000000000 100 0 0 10 0
   1: 0000000000000000FFFF00000200007F:20D0 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1003        0 6 1 0000000000000000 100 0 0 10 0
";

    fn uids(l: Vec<Listener>) -> Vec<u32> {
        l.into_iter().map(|l| l.uid).collect()
    }

    #[test]
    fn listeners_are_read_from_the_kernel_table() {
        // Port 0x20D0 = 8400: two listeners (uid 999 on 127.0.0.1, uid 1001 on 0.0.0.0); the
        // established connection (state 01) does not count.
        let v4 = parse_listeners(TCP, 8400);
        assert_eq!(
            v4.iter().map(|l| (l.uid, l.addr.to_string())).collect::<Vec<_>>(),
            [(999, "127.0.0.1".into()), (1001, "0.0.0.0".into())]
        );
        assert_eq!(uids(parse_listeners(TCP, 8080)), vec![0]);
        assert_eq!(uids(parse_listeners(TCP, 9)), Vec::<u32>::new());
        let v6 = parse_listeners(TCP6, 8400);
        assert_eq!(
            v6.iter().map(|l| (l.uid, l.addr.to_string())).collect::<Vec<_>>(),
            [(1002, "::1".into()), (1003, "::ffff:127.0.0.2".into())]
        );
        assert_eq!(classify(&[999, 1001], 999), PortOwner::Other { uid: 1001 });
        assert_eq!(classify(&[999], 999), PortOwner::Worker);
        assert_eq!(classify(&[], 999), PortOwner::Nobody);
    }

    #[test]
    fn only_sockets_a_call_could_reach_count() {
        let at = |addr: &str, v6only: bool| Listener { port: 1, uid: 7, addr: addr.parse().unwrap(), v6only, inode: 0 };
        let lo: IpAddr = "127.0.0.1".parse().unwrap();
        let lo6: IpAddr = "::1".parse().unwrap();
        for (l, to_lo, to_lo6) in [
            (at("127.0.0.1", false), true, false),
            (at("::ffff:127.0.0.1", false), true, false),
            (at("127.0.0.2", false), false, false),
            (at("0.0.0.0", false), true, false),
            (at("::1", false), false, true),
            (at("::", false), true, true),
            (at("::", true), false, true),
        ] {
            assert_eq!((l.receives(lo), l.receives(lo6)), (to_lo, to_lo6), "{l:?}");
        }
        assert!(at("127.0.0.2", false).receives("0.0.0.0".parse().unwrap()), "a call to 0.0.0.0: any socket");
    }

    /// A listening IPv6 socket on `[::]:0` with `IPV6_V6ONLY` set to `v6only`; its port.
    fn listen_v6_any(v6only: bool) -> Option<(std::os::fd::OwnedFd, u16)> {
        use std::os::fd::FromRawFd;
        // SAFETY: plain syscalls on a fresh descriptor owned by `fd`; the option and address
        // structs are valid for the lengths given.
        unsafe {
            let raw = libc::socket(libc::AF_INET6, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
            if raw < 0 {
                return None;
            }
            let fd = std::os::fd::OwnedFd::from_raw_fd(raw);
            let on = libc::c_int::from(v6only);
            let len = std::mem::size_of::<libc::c_int>() as u32;
            libc::setsockopt(raw, libc::IPPROTO_IPV6, libc::IPV6_V6ONLY, (&on as *const libc::c_int).cast(), len);
            let mut addr: libc::sockaddr_in6 = std::mem::zeroed();
            addr.sin6_family = libc::AF_INET6 as u16;
            let alen = std::mem::size_of::<libc::sockaddr_in6>() as u32;
            if libc::bind(raw, (&addr as *const libc::sockaddr_in6).cast(), alen) != 0 || libc::listen(raw, 1) != 0 {
                return None;
            }
            let mut alen = alen;
            libc::getsockname(raw, (&mut addr as *mut libc::sockaddr_in6).cast(), &mut alen);
            Some((fd, u16::from_be(addr.sin6_port)))
        }
    }

    #[test]
    fn the_kernel_says_which_ipv6_sockets_take_ipv4_calls() {
        for v6only in [true, false] {
            let Some((_fd, port)) = listen_v6_any(v6only) else { return };
            let found: Vec<Listener> = netlink_listeners().unwrap().into_iter().filter(|l| l.port == port).collect();
            assert_eq!(found.len(), 1, "{found:?}");
            assert_eq!((found[0].addr.to_string(), found[0].v6only), ("::".to_string(), v6only));
            assert_eq!(found[0].receives(IpAddr::from([127, 0, 0, 1])), !v6only);
        }
    }

    #[test]
    fn a_real_listener_shows_its_owner() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // SAFETY: plain syscall.
        let me = unsafe { libc::geteuid() };
        assert_eq!(owner(port, me, None).unwrap(), PortOwner::Worker);
        assert_eq!(owner(port, me.wrapping_add(1), None).unwrap(), PortOwner::Other { uid: me });
        drop(l);
        assert_eq!(owner(port, me, None).unwrap(), PortOwner::Nobody);
        assert!(is_this_node("127.0.0.1") && is_this_node("::1") && is_this_node("localhost") && is_this_node("0.0.0.0"));
        assert!(!is_this_node("192.0.2.7"));
        // Netlink and /proc agree.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let via_netlink: Vec<Listener> = netlink_listeners().unwrap().into_iter().filter(|l| l.port == port).collect();
        let lo = IpAddr::from([127, 0, 0, 1]);
        assert_eq!(via_netlink.len(), 1, "{via_netlink:?}");
        assert_eq!((via_netlink[0].uid, via_netlink[0].addr, via_netlink[0].v6only), (me, lo, false));
        assert_eq!(proc_listeners(port).unwrap(), via_netlink);
        // The socket names its process: this one, and nobody under another account.
        let inode = via_netlink[0].inode;
        assert_ne!(inode, 0);
        assert_eq!(holders(me, &[inode]), vec![std::process::id()]);
        assert_eq!(holders(me.wrapping_add(1), &[inode]), Vec::<u32>::new());
        assert_eq!(holders(me, &[0]), Vec::<u32>::new(), "an unknown inode names nobody");
        drop(l);
        assert_eq!(holders(me, &[inode]), Vec::<u32>::new(), "a closed socket names nobody");
        let l6 = std::net::TcpListener::bind("[::1]:0");
        if let Ok(l6) = l6 {
            let p6 = l6.local_addr().unwrap().port();
            assert_eq!(uids(listeners_on(p6).unwrap()), vec![me], "IPv6 listeners count too");
            // Another address on the same port: counted for calls to that address only.
            assert_eq!(owner(p6, me.wrapping_add(1), Some(&[lo])).unwrap(), PortOwner::Nobody);
            assert_eq!(owner(p6, me.wrapping_add(1), targets_of("localhost").as_deref()).unwrap(), PortOwner::Other { uid: me });
            assert_eq!(owner(p6, me.wrapping_add(1), targets_of("[::1]").as_deref()).unwrap(), PortOwner::Other { uid: me });
        }
        assert_eq!(host_port("http://[::1]:8000/x"), Some(("::1".to_string(), 8000)));
        assert_eq!(targets_of("gpu01"), None);
        assert_eq!(targets_of("0.0.0.0"), None);
        assert_eq!(host_port("http://gpu01:20001"), Some(("gpu01".to_string(), 20001)));
        assert_eq!(host_port("https://gpu01:1"), None);
    }
}
