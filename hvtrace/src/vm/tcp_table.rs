//! Who is at the other end of a TCP connection on this host, from the
//! kernel's socket tables (`/proc/net/tcp` and `/proc/net/tcp6`) and the
//! processes' open files (`/proc/<pid>/fd`).
//!
//! A row of the table gives a socket's local and remote address, its owner's
//! user id and its inode; a process's descriptor of that socket is a link
//! that reads `socket:[<inode>]`. The other end of a connection we accepted
//! is the row whose local address is our peer's address and whose remote
//! address is ours. Both ends live in this network namespace (the address is
//! 127.0.0.1), whose tables are the ones `/proc/net` shows.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::path::Path;

/// The kernel's TCP tables: IPv4, then IPv6 (where a dual-stack socket
/// connected to an IPv4 address shows it as `::ffff:a.b.c.d`).
const TABLES: [&str; 2] = ["/proc/net/tcp", "/proc/net/tcp6"];

/// One socket of a TCP table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcpRow {
    /// Its own address (an IPv4-mapped IPv6 address is given as IPv4).
    pub local: SocketAddr,
    /// The address it is connected to (`0.0.0.0:0` for a listener).
    pub remote: SocketAddr,
    /// The user id of its owner.
    pub uid: u32,
    /// Its inode; 0 for a connection no process holds any more (TIME_WAIT).
    pub inode: u64,
}

/// Parses the text of `/proc/net/tcp` or `/proc/net/tcp6`. The header line
/// and lines that do not parse are skipped.
pub fn parse_table(text: &str) -> Vec<TcpRow> {
    text.lines().filter_map(parse_row).collect()
}

/// Parses one line: `sl local remote st tx:rx tr:when retrnsmt uid timeout
/// inode ...`, whitespace-separated.
fn parse_row(line: &str) -> Option<TcpRow> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    if fields.len() < 10 || !fields[0].ends_with(':') {
        return None;
    }
    Some(TcpRow {
        local: parse_addr(fields[1])?,
        remote: parse_addr(fields[2])?,
        uid: fields[7].parse().ok()?,
        inode: fields[9].parse().ok()?,
    })
}

/// Parses `ADDR:PORT` in hex. The port is a plain number (`1F90` is 8080);
/// the address is the kernel's 32-bit words of the address in network byte
/// order, each printed as a number of the host's byte order, which on the
/// little-endian hosts hvtrace runs on reverses each word: `0100007F` is
/// 127.0.0.1. An IPv6 address is four such words; an IPv4-mapped one is
/// returned as IPv4.
fn parse_addr(text: &str) -> Option<SocketAddr> {
    let (addr, port) = text.split_once(':')?;
    if port.len() != 4 {
        return None;
    }
    let port = u16::from_str_radix(port, 16).ok()?;
    let ip = match addr.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word_bytes(addr)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word_bytes(&addr[i * 8..i * 8 + 8])?);
            }
            let v6 = Ipv6Addr::from(bytes);
            match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(v6),
            }
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The four bytes, in memory order, of a 32-bit word the kernel printed as
/// eight hex digits.
fn word_bytes(hex: &str) -> Option<[u8; 4]> {
    if hex.len() != 8 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    Some(u32::from_str_radix(hex, 16).ok()?.to_ne_bytes())
}

/// The socket, held by a process, whose local address is `local` and whose
/// remote address is `remote`: the other end of our connection from
/// `remote` (ours) to `local` (the peer's).
pub fn find_row(rows: &[TcpRow], local: SocketAddr, remote: SocketAddr) -> Option<&TcpRow> {
    rows.iter()
        .find(|r| r.local == local && r.remote == remote && r.inode != 0)
}

/// The inode of a descriptor link's target, `socket:[<inode>]`.
pub fn socket_inode(link: &Path) -> Option<u64> {
    let text = link.to_str()?;
    text.strip_prefix("socket:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

/// The inodes of the sockets that process `pid` holds open. A descriptor
/// closed while the directory is read is skipped.
pub fn socket_inodes(pid: u32) -> io::Result<Vec<u64>> {
    let mut inodes = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let Ok(entry) = entry else { continue };
        if let Some(inode) = std::fs::read_link(entry.path())
            .ok()
            .and_then(|target| socket_inode(&target))
        {
            inodes.push(inode);
        }
    }
    Ok(inodes)
}

/// The rows of both tables (a table the kernel does not have, such as
/// `tcp6` with IPv6 off, counts as empty).
pub fn read_tables() -> io::Result<Vec<TcpRow>> {
    let mut rows = Vec::new();
    for table in TABLES {
        match std::fs::read_to_string(table) {
            Ok(text) => rows.extend(parse_table(&text)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(rows)
}

/// Checks that the other end of `stream`, a connection accepted from
/// 127.0.0.1, is a socket that user `uid` owns and that process `pid` holds.
/// The error says why not.
pub fn verify_peer(stream: &TcpStream, pid: u32, uid: u32) -> Result<(), String> {
    let ours = stream
        .local_addr()
        .map_err(|e| format!("cannot read the connection's address: {e}"))?;
    let theirs = stream
        .peer_addr()
        .map_err(|e| format!("cannot read the peer's address: {e}"))?;
    let rows = read_tables().map_err(|e| format!("cannot read the kernel's TCP table: {e}"))?;
    let Some(row) = find_row(&rows, theirs, ours) else {
        return Err(format!(
            "no socket {theirs} -> {ours} in the kernel's TCP table"
        ));
    };
    if row.uid != uid {
        return Err(format!(
            "the connection from {theirs} belongs to uid {}, not {uid}",
            row.uid
        ));
    }
    let held = socket_inodes(pid)
        .map_err(|e| format!("cannot list the open files of process {pid}: {e}"))?;
    if !held.contains(&row.inode) {
        return Err(format!(
            "the connection from {theirs} (socket inode {}) is not held by process {pid}",
            row.inode
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as Linux prints them: a listener on 127.0.0.1:8080, our
    /// accepted socket, the client's end (uid 1000, inode 424242), a
    /// TIME_WAIT leftover and one line cut short.
    const TCP: &str = "\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 31337 1 0000000000000000 100 0 0 10 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 424243 1 0000000000000000 20 4 30 10 -1
   2: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 424242 1 0000000000000000 20 4 30 10 -1
   3: 0100007F:C000 0100007F:1F90 06 00000000:00000000 03:00000DE1 00000000     0        0 0 3 0000000000000000
   4: 0100007F:C001
";

    fn addr(text: &str) -> SocketAddr {
        text.parse().unwrap()
    }

    #[test]
    fn ipv4_is_little_endian_hex() {
        assert_eq!(parse_addr("0100007F:1F90"), Some(addr("127.0.0.1:8080")));
        assert_eq!(parse_addr("0101A8C0:0016"), Some(addr("192.168.1.1:22")));
        assert_eq!(parse_addr("00000000:0000"), Some(addr("0.0.0.0:0")));
        assert_eq!(parse_addr("0100007F:FFFF"), Some(addr("127.0.0.1:65535")));
        assert_eq!(parse_addr("0100007F"), None);
        assert_eq!(parse_addr("100007F:1F90"), None);
        assert_eq!(parse_addr("0100007G:1F90"), None);
        assert_eq!(parse_addr("+100007F:1F90"), None);
        assert_eq!(parse_addr("0100007F:1F9"), None);
    }

    #[test]
    fn ipv6_words_and_mapped_ipv4() {
        // ::1
        assert_eq!(
            parse_addr("00000000000000000000000001000000:0050"),
            Some(addr("[::1]:80"))
        );
        // ::ffff:127.0.0.1 is given as IPv4.
        assert_eq!(
            parse_addr("0000000000000000FFFF00000100007F:1F90"),
            Some(addr("127.0.0.1:8080"))
        );
        // fe80::1
        assert_eq!(
            parse_addr("000080FE000000000000000001000000:0016"),
            Some(addr("[fe80::1]:22"))
        );
    }

    #[test]
    fn rows_of_a_table() {
        let rows = parse_table(TCP);
        assert_eq!(rows.len(), 4, "the header and the short line are skipped");
        assert_eq!(
            rows[0],
            TcpRow {
                local: addr("127.0.0.1:8080"),
                remote: addr("0.0.0.0:0"),
                uid: 1000,
                inode: 31337,
            }
        );
        assert_eq!(rows[2].local, addr("127.0.0.1:54321"));
        assert_eq!(rows[2].inode, 424242);
        assert_eq!(rows[3].uid, 0);
        assert_eq!(rows[3].inode, 0);
    }

    #[test]
    fn the_peer_is_the_reversed_row() {
        let rows = parse_table(TCP);
        let ours = addr("127.0.0.1:8080");
        let theirs = addr("127.0.0.1:54321");
        let row = find_row(&rows, theirs, ours).unwrap();
        assert_eq!((row.uid, row.inode), (1000, 424242));
        // Our own end is the other way round.
        assert_eq!(find_row(&rows, ours, theirs).unwrap().inode, 424243);
        // A TIME_WAIT row belongs to nobody.
        assert_eq!(find_row(&rows, addr("127.0.0.1:49152"), ours), None);
        assert_eq!(find_row(&rows, addr("127.0.0.1:1"), ours), None);
    }

    #[test]
    fn socket_links() {
        assert_eq!(socket_inode(Path::new("socket:[424242]")), Some(424242));
        assert_eq!(socket_inode(Path::new("pipe:[424242]")), None);
        assert_eq!(socket_inode(Path::new("/tmp/socket:[1]")), None);
        assert_eq!(socket_inode(Path::new("socket:[]")), None);
    }

    #[test]
    fn our_own_connection_is_in_the_table() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (served, _) = listener.accept().unwrap();
        let rows = read_tables().unwrap();
        let row = find_row(
            &rows,
            served.peer_addr().unwrap(),
            served.local_addr().unwrap(),
        )
        .expect("the client's socket is in the table");
        assert_eq!(row.uid, crate::sys::euid());
        assert!(socket_inodes(std::process::id())
            .unwrap()
            .contains(&row.inode));
        drop(client);
    }
}
