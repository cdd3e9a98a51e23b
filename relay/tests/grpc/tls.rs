//! Token, TLS and mTLS, and relayctl's token and TLS flags.

use super::*;

#[tokio::test]
async fn bearer_token_is_required_and_checked() {
    let cfg = ServerConfig { bearer_token: Some("s3cret".into()), ..cfg() };
    let relay = Relay::start(cfg, big_history()).await;
    let mut client = relay.client().await;
    let err = client.status(pb::StatusRequest {}).await.unwrap_err();
    assert_eq!(err.code(), Code::Unauthenticated);
    let with = |t: &str| {
        let mut r = tonic::Request::new(pb::StatusRequest {});
        r.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
        r
    };
    assert_eq!(client.status(with("wrong")).await.unwrap_err().code(), Code::Unauthenticated);
    client.status(with("s3cret")).await.unwrap();
    let mut sub = tonic::Request::new(req(0, 0, 0, true));
    sub.metadata_mut().insert("authorization", "Bearer wrong".parse().unwrap());
    assert_eq!(client.subscribe(sub).await.unwrap_err().code(), Code::Unauthenticated);

    // Health stays open for probes.
    let mut health = tonic_health::pb::health_client::HealthClient::new(
        Endpoint::from_shared(format!("http://{}", relay.addr)).unwrap().connect().await.unwrap(),
    );
    let h = health.check(tonic_health::pb::HealthCheckRequest { service: "kv_relay.v1.Relay".into() }).await.unwrap();
    assert_eq!(h.into_inner().status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    relay.stop().await;
}

struct Pki {
    ca: String,
    server_cert: String,
    server_key: String,
    client_cert: String,
    client_key: String,
}

fn pki() -> Pki {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let leaf = |eku| {
        let mut p = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
        p.extended_key_usages = vec![eku];
        let key = KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &ca).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(ExtendedKeyUsagePurpose::ServerAuth);
    let (client_cert, client_key) = leaf(ExtendedKeyUsagePurpose::ClientAuth);
    Pki { ca: ca.pem(), server_cert, server_key, client_cert, client_key }
}

async fn tls_client(
    addr: SocketAddr,
    ca: &str,
    identity: Option<(&str, &str)>,
) -> Result<RelayClient<Channel>, String> {
    let mut tls =
        ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(ca)).domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
    }
    let ep = Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).map_err(|e| e.to_string())?;
    let ch = ep.connect().await.map_err(|e| format!("{e:?}"))?;
    Ok(RelayClient::new(ch))
}

/// A call that must fail, at connect or at the first RPC (TLS 1.3 reports a refused client
/// certificate after the handshake).
async fn refused(c: Result<RelayClient<Channel>, String>) -> bool {
    match c {
        Err(_) => true,
        Ok(mut c) => c.status(pb::StatusRequest {}).await.is_err(),
    }
}

#[tokio::test]
async fn tls_serves_trusting_clients_and_refuses_plaintext() {
    let p = pki();
    let tls = TlsConfig { cert_pem: p.server_cert.into(), key_pem: p.server_key.into(), client_ca_pem: None };
    let relay = Relay::start(ServerConfig { tls: Some(tls), ..cfg() }, big_history()).await;
    let mut c = tls_client(relay.addr, &p.ca, None).await.unwrap();
    c.status(pb::StatusRequest {}).await.unwrap();
    // Plaintext to a TLS port fails.
    let plain = Endpoint::from_shared(format!("http://{}", relay.addr)).unwrap().connect().await;
    if let Ok(ch) = plain {
        assert!(RelayClient::new(ch).status(pb::StatusRequest {}).await.is_err());
    }
    // A client that does not trust the server's CA refuses it.
    let other = pki();
    assert!(refused(tls_client(relay.addr, &other.ca, None).await).await);
    relay.stop().await;
}

/// A relay serving TLS with `p`'s server certificate, requiring a client certificate from `p`'s CA.
async fn start_mtls(p: &Pki) -> Relay {
    let tls = TlsConfig {
        cert_pem: p.server_cert.clone().into(),
        key_pem: p.server_key.clone().into(),
        client_ca_pem: Some(p.ca.clone().into()),
    };
    Relay::start(ServerConfig { tls: Some(tls), ..cfg() }, big_history()).await
}

#[tokio::test]
async fn mtls_requires_a_client_certificate_from_the_configured_ca() {
    let p = pki();
    let relay = start_mtls(&p).await;
    let mut c = tls_client(relay.addr, &p.ca, Some((&p.client_cert, &p.client_key))).await.unwrap();
    c.status(pb::StatusRequest {}).await.unwrap();
    // No client certificate.
    assert!(refused(tls_client(relay.addr, &p.ca, None).await).await);
    // A client certificate from another CA.
    let other = pki();
    assert!(refused(tls_client(relay.addr, &p.ca, Some((&other.client_cert, &other.client_key))).await).await);
    relay.stop().await;
}

// relayctl's token and TLS flags

/// The real `relayctl ARGS` with `env` and no other `KV_RELAY_*` variable, off the runtime's
/// thread: (exit status, stdout, stderr).
async fn relayctl(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_relayctl"));
    for (k, _) in std::env::vars() {
        if k.starts_with("KV_RELAY_") {
            c.env_remove(k);
        }
    }
    c.args(args).envs(env.iter().copied()).stdin(std::process::Stdio::null());
    let out = tokio::task::spawn_blocking(move || c.output().unwrap()).await.unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (out.status.code().expect("relayctl exited by a signal"), text(out.stdout), text(out.stderr))
}

/// `relayctl status --json`'s `relay` field, after a successful run.
fn relay_of(run: (i32, String, String)) -> String {
    let (code, out, err) = run;
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    v["relay"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn relayctl_sends_the_token_from_its_flag_or_environment_and_exits_77_when_refused() {
    let relay = Relay::start(ServerConfig { bearer_token: Some("s3cret".into()), ..cfg() }, big_history()).await;
    let url = format!("http://{}", relay.addr);
    let (code, out, missing) = relayctl(&["--relay", &url, "status"], &[]).await;
    assert_eq!((code, out.as_str()), (77, ""), "{missing}");
    insta::assert_snapshot!("relayctl_token_missing", missing.replace(&url, "[relay]"));
    let wrong = relayctl(&["--relay", &url, "--token", "guess", "snapshot"], &[]).await;
    assert_eq!(wrong, (77, String::new(), missing.clone()));
    let wrong = relayctl(&["--relay", &url, "history"], &[("KV_RELAY_TOKEN", "guess")]).await;
    assert_eq!(wrong, (77, String::new(), missing.clone()));

    assert_eq!(relay_of(relayctl(&["--relay", &url, "--token", "s3cret", "status", "--json"], &[]).await), url);
    let env = [("KV_RELAY_ADDR", url.as_str()), ("KV_RELAY_TOKEN", "s3cret")];
    assert_eq!(relay_of(relayctl(&["status", "--json"], &env).await), url);
    relay.stop().await;
}

#[tokio::test]
async fn relayctl_verifies_the_relay_and_presents_its_certificate_with_its_tls_flags() {
    let p = pki();
    let relay = start_mtls(&p).await;
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, pem: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, pem).unwrap();
        path.display().to_string()
    };
    let (ca, cert, key) =
        (file("ca.pem", &p.ca), file("client.pem", &p.client_cert), file("client.key", &p.client_key));
    // HOST:PORT with a --tls-* flag means https.
    let host_port = relay.addr.to_string();
    let https = format!("https://{host_port}");
    let flags =
        ["--relay", &host_port, "--tls-ca", &ca, "--tls-cert", &cert, "--tls-key", &key, "--tls-domain", "localhost"];
    assert_eq!(relay_of(relayctl(&[&flags[..], &["status", "--json"]].concat(), &[]).await), https);
    let env = [
        ("KV_RELAY_ADDR", https.as_str()),
        ("KV_RELAY_TLS_CA", &ca),
        ("KV_RELAY_TLS_CERT", &cert),
        ("KV_RELAY_TLS_KEY", &key),
        ("KV_RELAY_TLS_DOMAIN", "localhost"),
    ];
    assert_eq!(relay_of(relayctl(&["status", "--json"], &env).await), https);

    // Without the client certificate, or trusting another CA: refused, and said so.
    let (code, out, no_cert) = relayctl(&[&flags[..4], &flags[8..], &["status"]].concat(), &[]).await;
    assert_eq!((code, out.as_str()), (69, ""), "{no_cert}");
    insta::assert_snapshot!("relayctl_tls_no_client_certificate", no_cert.replace(&host_port, "[addr]"));
    let other = file("other-ca.pem", &pki().ca);
    let (code, out, untrusted) =
        relayctl(&["--relay", &https, "--tls-ca", &other, "--tls-domain", "localhost", "status"], &[]).await;
    assert_eq!((code, out.as_str()), (69, ""), "{untrusted}");
    insta::assert_snapshot!("relayctl_tls_untrusted_relay", untrusted.replace(&host_port, "[addr]"));
    relay.stop().await;
}
