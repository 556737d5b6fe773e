//! Network partitions for the tests: a UDP proxy in front of each member, dropping the
//! datagrams between members the test has cut apart.
//!
//! Each member binds its real endpoint and is known to the others (its raft address) only by
//! its proxy's address. A member's QUIC endpoint sends everything from its one bound socket, so
//! the proxy in front of member `i` recognises member `j` by the datagram's source address and
//! drops it while `j → i` is cut; the answers flow back through the same proxy and are dropped
//! while `i → j` is cut. Anything from an address that is no member (an operator's client) always
//! passes. QUIC sees loss, nothing else: timeouts, retransmissions and connection loss are the
//! transport's own.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use strata_topology::NodeId;
use tokio::net::UdpSocket;
use tokio::task::JoinHandle;

/// Which members can hear which, shared by every proxy of a group.
#[derive(Default)]
pub struct Faults {
    /// Real (bound) address of each member.
    members: Mutex<HashMap<SocketAddr, NodeId>>,
    /// Directed pairs `(from, to)` whose datagrams are dropped.
    cut: Mutex<BTreeSet<(NodeId, NodeId)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Faults {
    /// Records that member `id` sends from `bound`.
    pub fn member(&self, id: NodeId, bound: SocketAddr) {
        lock(&self.members).insert(bound, id);
    }

    /// Cuts every pair across `a` and `b`, both ways.
    pub fn partition(&self, a: &[NodeId], b: &[NodeId]) {
        let mut cut = lock(&self.cut);
        for &x in a {
            for &y in b {
                cut.insert((x, y));
                cut.insert((y, x));
            }
        }
    }

    pub fn heal(&self) {
        lock(&self.cut).clear();
    }

    fn passes(&self, from: Option<NodeId>, to: NodeId) -> bool {
        from.is_none_or(|from| !lock(&self.cut).contains(&(from, to)))
    }

    fn sender(&self, addr: SocketAddr) -> Option<NodeId> {
        lock(&self.members).get(&addr).copied()
    }
}

/// A proxy in front of one member; dropped, it stops forwarding.
pub struct Proxy {
    /// The address the other members and clients use for this member.
    pub addr: SocketAddr,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }
}

const DATAGRAM: usize = 65_536;

impl Proxy {
    /// Forwards datagrams for member `id` at `target`, subject to `faults`.
    pub async fn start(id: NodeId, target: SocketAddr, faults: Arc<Faults>) -> Proxy {
        let front = Arc::new(
            UdpSocket::bind("127.0.0.1:0")
                .await
                .expect("bind a proxy socket"),
        );
        let addr = front.local_addr().expect("bound");
        let tasks = Arc::new(Mutex::new(Vec::new()));
        let forwarding = {
            let tasks = Arc::clone(&tasks);
            tokio::spawn(async move {
                // One upstream socket per peer address, so the member's answers can be told
                // apart and sent back to the right peer from the front socket.
                let mut upstream: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
                let mut buf = vec![0u8; DATAGRAM];
                loop {
                    let Ok((len, peer)) = front.recv_from(&mut buf).await else {
                        return;
                    };
                    let from = faults.sender(peer);
                    if !faults.passes(from, id) {
                        continue;
                    }
                    let socket = match upstream.get(&peer) {
                        Some(s) => Arc::clone(s),
                        None => {
                            let Ok(socket) = UdpSocket::bind("127.0.0.1:0").await else {
                                continue;
                            };
                            if socket.connect(target).await.is_err() {
                                continue;
                            }
                            let socket = Arc::new(socket);
                            let back = answers(
                                Arc::clone(&socket),
                                Arc::clone(&front),
                                peer,
                                from,
                                id,
                                Arc::clone(&faults),
                            );
                            lock(&tasks).push(tokio::spawn(back));
                            upstream.insert(peer, Arc::clone(&socket));
                            socket
                        }
                    };
                    let _ = socket.send(&buf[..len]).await;
                }
            })
        };
        lock(&tasks).push(forwarding);
        Proxy { addr, tasks }
    }
}

/// The member's answers to `peer`, sent from the front socket unless `member → peer` is cut.
async fn answers(
    upstream: Arc<UdpSocket>,
    front: Arc<UdpSocket>,
    peer: SocketAddr,
    peer_id: Option<NodeId>,
    member: NodeId,
    faults: Arc<Faults>,
) {
    let mut buf = vec![0u8; DATAGRAM];
    while let Ok(len) = upstream.recv(&mut buf).await {
        let blocked = peer_id.is_some_and(|p| !faults.passes(Some(member), p));
        if !blocked {
            let _ = front.send_to(&buf[..len], peer).await;
        }
    }
}
