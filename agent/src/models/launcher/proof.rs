//! Proof that the process answering on a worker's port is the worker.
//!
//! Any user on the node can bind a free port on 127.0.0.1. A health probe alone cannot tell
//! the worker from another user's process there (a squatter answers whatever it likes, and
//! then receives every caller's prompts). The kernel can: `/proc/net/tcp` and `tcp6` list each
//! listening socket with the uid that owns it. A worker is ready only when every socket
//! listening on its port belongs to the worker account; a socket of another uid there is a
//! squatter, and the load fails with a message that says so.
//!
//! This needs the worker on this node's network namespace (the `local` launcher, and Slurm
//! jobs on the agent's own node, the reference setup). For a worker on another host the
//! owner cannot be checked; the probe still requires the worker's key.

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
        assert_eq!(host_port("http://[::1]:8000/x"), Some(("::1".to_string(), 8000)));
        assert_eq!(host_port("http://gpu01:20001"), Some(("gpu01".to_string(), 20001)));
        assert_eq!(host_port("https://gpu01:1"), None);
    }
}
