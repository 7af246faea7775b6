//! Proof that the process answering on a worker's port is the worker.
//!
//! Any user on the node can bind a free port on 127.0.0.1. A health probe alone cannot tell
//! the worker from another user's process there (a squatter answers whatever it likes, and
//! then receives every caller's prompts). The kernel can: `/proc/net/tcp` and `tcp6` list each
//! listening socket with the uid that owns it. A worker is ready only when every socket
//! listening on its port belongs to the worker account; a socket of another uid there is a
//! squatter, and the load fails with a message that says so.
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

/// The uids of the sockets in LISTEN state on `port` (any local address, IPv4 and IPv6).
pub fn listening_uids(port: u16) -> std::io::Result<Vec<u32>> {
    match netlink_listeners() {
        Ok(all) => Ok(all.into_iter().filter(|(p, _)| *p == port).map(|(_, uid)| uid).collect()),
        Err(e) => {
            tracing::debug!(error = %e, "sock_diag netlink refused; reading /proc/net/tcp");
            proc_listening_uids(port)
        }
    }
}

/// `(port, uid)` of every listening TCP socket (IPv4 and IPv6), from `NETLINK_SOCK_DIAG`.
pub fn netlink_listeners() -> std::io::Result<Vec<(u16, u32)>> {
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
fn parse_diag(mut data: &[u8], seq: u32, out: &mut Vec<(u16, u32)>) -> std::io::Result<bool> {
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
                    // inet_diag_msg: family, state, timer, retrans, then inet_diag_sockid
                    // (sport big-endian first), ..., uid at byte 64.
                    let port = body.get(4..6).map(|p| u16::from_be_bytes([p[0], p[1]])).ok_or_else(bad)?;
                    let uid = u32_at(body, 64).ok_or_else(bad)?;
                    out.push((port, uid));
                }
            }
        }
        data = &data[((len + 3) & !3).min(data.len())..];
    }
    Ok(false)
}

/// [`listening_uids`] from `/proc/net/tcp` and `tcp6`.
pub fn proc_listening_uids(port: u16) -> std::io::Result<Vec<u32>> {
    let mut uids = Vec::new();
    let mut found_table = false;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        match std::fs::read_to_string(table) {
            Ok(text) => {
                found_table = true;
                uids.extend(parse_listeners(&text, port));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    if !found_table {
        return Err(std::io::Error::new(std::io::ErrorKind::NotFound, "neither /proc/net/tcp nor /proc/net/tcp6 exists"));
    }
    Ok(uids)
}

/// Who listens on `port`, against the worker's `uid`.
pub fn owner(port: u16, uid: u32) -> std::io::Result<PortOwner> {
    let uids = listening_uids(port)?;
    Ok(classify(&uids, uid))
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

/// `gpuhub-agent worker-proof PORT JOBID FILE SECS`, run by a Slurm worker job on its own node
/// as the worker account: waits (at most `secs`) until something listens on `port`, then
/// writes `JOBID PORT ok` to `file` when every listener there is this process's uid, `JOBID
/// PORT uid N` when another uid listens (written to `FILE.tmp` and renamed). Nothing written
/// when nothing listened in time (the agent's load timeout then fails the load).
pub fn prove_port(port: u16, job: &str, file: &std::path::Path, secs: u64) -> std::io::Result<bool> {
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    let mut delay = std::time::Duration::from_millis(5);
    loop {
        let line = match owner(port, me)? {
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
/// address `HEXIP:HEXPORT`, state `0A` = LISTEN, uid the 8th column.
pub fn parse_listeners(text: &str, port: u16) -> Vec<u32> {
    text.lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let local = f.get(1)?;
            let state = f.get(3)?;
            let uid = f.get(7)?.parse::<u32>().ok()?;
            let p = u16::from_str_radix(local.rsplit_once(':')?.1, 16).ok()?;
            (*state == "0A" && p == port).then_some(uid)
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
        assert!(prove_port(port, "42", &file, 5).unwrap());
        assert_eq!(std::fs::read_to_string(&file).unwrap(), format!("42 {port} ok\n"));
        drop(l);
        let free = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap().local_addr().unwrap().port();
        let none = dir.path().join("m.43.proof");
        assert!(!prove_port(free, "43", &none, 0).unwrap(), "nothing listens: no proof");
        assert!(!none.exists());
    }

    #[test]
    fn listeners_are_read_from_the_kernel_table() {
        // Port 0x20D0 = 8400: two listeners (uid 999 on 127.0.0.1, uid 1001 on 0.0.0.0); the
        // established connection (state 01) does not count.
        assert_eq!(parse_listeners(TCP, 8400), vec![999, 1001]);
        assert_eq!(parse_listeners(TCP, 8080), vec![0]);
        assert_eq!(parse_listeners(TCP, 9), Vec::<u32>::new());
        assert_eq!(classify(&[999, 1001], 999), PortOwner::Other { uid: 1001 });
        assert_eq!(classify(&[999], 999), PortOwner::Worker);
        assert_eq!(classify(&[], 999), PortOwner::Nobody);
    }

    #[test]
    fn a_real_listener_shows_its_owner() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // SAFETY: plain syscall.
        let me = unsafe { libc::geteuid() };
        assert_eq!(owner(port, me).unwrap(), PortOwner::Worker);
        assert_eq!(owner(port, me.wrapping_add(1)).unwrap(), PortOwner::Other { uid: me });
        drop(l);
        assert_eq!(owner(port, me).unwrap(), PortOwner::Nobody);
        assert!(is_this_node("127.0.0.1") && is_this_node("::1") && is_this_node("localhost") && is_this_node("0.0.0.0"));
        assert!(!is_this_node("192.0.2.7"));
        // Netlink and /proc agree.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let via_netlink: Vec<u32> = netlink_listeners().unwrap().into_iter().filter(|(p, _)| *p == port).map(|(_, u)| u).collect();
        assert_eq!(via_netlink, vec![me]);
        assert_eq!(proc_listening_uids(port).unwrap(), vec![me]);
        let l6 = std::net::TcpListener::bind("[::1]:0");
        if let Ok(l6) = l6 {
            let p6 = l6.local_addr().unwrap().port();
            assert_eq!(listening_uids(p6).unwrap(), vec![me], "IPv6 listeners count too");
        }
        assert_eq!(host_port("http://[::1]:8000/x"), Some(("::1".to_string(), 8000)));
        assert_eq!(host_port("http://gpu01:20001"), Some(("gpu01".to_string(), 20001)));
        assert_eq!(host_port("https://gpu01:1"), None);
    }
}
