//! Per-rank endpoints, derived as the engines derive them (`offset_endpoint_port`): rank 0 keeps
//! the endpoint; `tcp://host:port` adds the rank to the port after the last `:`; `inproc://name`
//! gets a `_dp{rank}` suffix; other transports have no rank offset.

/// Why an endpoint cannot be offset for a rank.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EndpointError {
    #[error("endpoint {0:?} has no port to offset for dp rank {1}")]
    NoPort(String, u32),
    #[error("endpoint {0:?}: port + dp rank {1} is beyond 65535")]
    PortOverflow(String, u32),
    #[error("endpoint {0:?}: only tcp:// and inproc:// endpoints can be offset for dp rank {1}")]
    Transport(String, u32),
}

/// The endpoint of DP rank `rank` given the rank-0 endpoint.
pub fn for_rank(endpoint: &str, rank: u32) -> Result<String, EndpointError> {
    if rank == 0 {
        return Ok(endpoint.to_string());
    }
    if endpoint.contains("inproc") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    if endpoint.contains("tcp") {
        let (head, port) = endpoint.rsplit_once(':').ok_or_else(|| EndpointError::NoPort(endpoint.into(), rank))?;
        let port: u32 = port.parse().map_err(|_| EndpointError::NoPort(endpoint.into(), rank))?;
        if port == 0 {
            // vLLM 0.31+: an ephemeral port is left alone.
            return Ok(endpoint.to_string());
        }
        let p = port + rank;
        if p > 65535 {
            return Err(EndpointError::PortOverflow(endpoint.into(), rank));
        }
        return Ok(format!("{head}:{p}"));
    }
    Err(EndpointError::Transport(endpoint.into(), rank))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_offset_like_the_engines() {
        assert_eq!(for_rank("tcp://127.0.0.1:5557", 0).unwrap(), "tcp://127.0.0.1:5557");
        assert_eq!(for_rank("tcp://127.0.0.1:5557", 3).unwrap(), "tcp://127.0.0.1:5560");
        assert_eq!(for_rank("tcp://[::1]:5557", 1).unwrap(), "tcp://[::1]:5558");
        assert_eq!(for_rank("inproc://kv", 2).unwrap(), "inproc://kv_dp2");
        assert_eq!(for_rank("tcp://h:0", 2).unwrap(), "tcp://h:0");
        assert_eq!(for_rank("ipc:///tmp/kv", 1), Err(EndpointError::Transport("ipc:///tmp/kv".into(), 1)));
        assert_eq!(for_rank("tcp://h:65535", 1), Err(EndpointError::PortOverflow("tcp://h:65535".into(), 1)));
        assert_eq!(for_rank("tcp://h", 1), Err(EndpointError::NoPort("tcp://h".into(), 1)));
    }
}
