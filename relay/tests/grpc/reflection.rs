//! Reflection.

use super::*;

#[tokio::test]
async fn reflection_lists_the_services() {
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;

    let relay = Relay::start(cfg(), big_history()).await;
    let ch = Endpoint::from_shared(format!("http://{}", relay.addr)).unwrap().connect().await.unwrap();
    let mut client = ServerReflectionClient::new(ch);
    let reqs = vec![
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        },
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol("kv_relay.v1.Relay".into())),
        },
    ];
    let mut resp = client.server_reflection_info(tokio_stream::iter(reqs)).await.unwrap().into_inner();
    let list = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = list.message_response else { panic!("not a list") };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert!(names.contains(&"kv_relay.v1.Relay".to_string()), "{names:?}");
    assert!(names.contains(&"grpc.health.v1.Health".to_string()), "{names:?}");
    let file = resp.message().await.unwrap().unwrap();
    let Some(MessageResponse::FileDescriptorResponse(fd)) = file.message_response else { panic!("not a file") };
    assert!(!fd.file_descriptor_proto.is_empty());
    relay.stop().await;
}
