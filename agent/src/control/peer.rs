//! Who is on the other end of the control socket.

use axum::extract::FromRequestParts;
use axum::extract::connect_info::{ConnectInfo, Connected};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::serve::IncomingStream;
use tokio::net::UnixListener;

use crate::AppState;

/// Kernel-reported credentials of the connecting process.
#[derive(Debug, Clone, Copy)]
pub struct PeerCred {
    pub uid: u32,
    pub gid: u32,
    pub pid: Option<i32>,
}

impl Connected<IncomingStream<'_, UnixListener>> for PeerCred {
    fn connect_info(stream: IncomingStream<'_, UnixListener>) -> Self {
        match stream.io().peer_cred() {
            Ok(c) => PeerCred { uid: c.uid(), gid: c.gid(), pid: c.pid() },
            // Unknown peer: treat as `nobody`, who sees nothing.
            Err(_) => PeerCred { uid: u32::MAX - 1, gid: u32::MAX - 1, pid: None },
        }
    }
}

/// The caller of a control request, resolved to a user name and an admin flag.
#[derive(Debug, Clone)]
pub struct Caller {
    pub uid: u32,
    pub user: String,
    pub admin: bool,
}

impl Caller {
    /// Fails with 403 unless the caller is an admin; the message says how to become one.
    pub fn require_admin(&self, what: &str) -> Result<(), (StatusCode, String)> {
        if self.admin {
            Ok(())
        } else {
            Err((
                StatusCode::FORBIDDEN,
                format!(
                    "{what} needs an admin: run it as root or as a member of the admin group (admin.group in agent.toml); you are `{}`",
                    self.user
                ),
            ))
        }
    }
}

impl FromRequestParts<AppState> for Caller {
    type Rejection = (StatusCode, String);

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, Self::Rejection> {
        let ConnectInfo(peer) = parts
            .extensions
            .get::<ConnectInfo<PeerCred>>()
            .copied()
            .ok_or((StatusCode::INTERNAL_SERVER_ERROR, "no peer credentials on this connection".to_string()))?;
        let user = user_name(peer.uid).unwrap_or_else(|| peer.uid.to_string());
        let admin = peer.uid == 0 || in_group(&user, peer.gid, &state.config.file.admin.group);
        Ok(Caller { uid: peer.uid, user, admin })
    }
}

/// Looks up a user name by uid (getpwuid_r).
pub fn user_name(uid: u32) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: buffers are valid for the given lengths; result points into pwd/buf on success.
    let rc = unsafe { libc::getpwuid_r(uid, &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() {
        return None;
    }
    // SAFETY: pw_name is a NUL-terminated string inside buf.
    let name = unsafe { std::ffi::CStr::from_ptr(pwd.pw_name) };
    Some(name.to_string_lossy().into_owned())
}

/// Looks up a uid by user name (getpwnam_r).
pub fn uid_of(name: &str) -> Option<u32> {
    ids_of(name).map(|(uid, _)| uid)
}

/// A user's uid and primary gid by name (getpwnam_r).
pub fn ids_of(name: &str) -> Option<(u32, u32)> {
    let cname = std::ffi::CString::new(name).ok()?;
    let mut buf = vec![0u8; 4096];
    // SAFETY: an all-zero `passwd` is a valid value for getpwnam_r to fill.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: buffers are valid for the given lengths; result points into pwd/buf on success.
    let rc = unsafe { libc::getpwnam_r(cname.as_ptr(), &mut pwd, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() {
        return None;
    }
    Some((pwd.pw_uid, pwd.pw_gid))
}

/// True if `user` (primary gid `gid`) is a member of the group `group`.
fn in_group(user: &str, gid: u32, group: &str) -> bool {
    let Ok(cgroup) = std::ffi::CString::new(group) else { return false };
    let mut buf = vec![0u8; 16384];
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut result: *mut libc::group = std::ptr::null_mut();
    // SAFETY: buffers are valid for the given lengths.
    let rc = unsafe { libc::getgrnam_r(cgroup.as_ptr(), &mut grp, buf.as_mut_ptr().cast(), buf.len(), &mut result) };
    if rc != 0 || result.is_null() {
        return false;
    }
    if grp.gr_gid == gid {
        return true;
    }
    let mut p = grp.gr_mem;
    // SAFETY: gr_mem is a NULL-terminated array of C strings inside buf.
    unsafe {
        while !p.is_null() && !(*p).is_null() {
            if std::ffi::CStr::from_ptr(*p).to_bytes() == user.as_bytes() {
                return true;
            }
            p = p.add(1);
        }
    }
    false
}
