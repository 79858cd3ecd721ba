//! The store server and the distributed client, in Rust, over loopback.

use std::sync::Arc;
use std::time::Duration;

use pstore::client::{Client, ClientConfig};
use pstore::net::proto::p_store_client::PStoreClient;
use pstore::net::proto::{CreateTableRequest, Dtype, PullRequest, PushRequest, RequestId};
use pstore::net::wire;
use pstore::server::{start, ServerConfig, ServerHandle};
use pstore::{Initializer, OptimizerConfig, SparseTableConfig, Store, StoreConfig};

fn server() -> ServerHandle {
    let store = Arc::new(Store::new(StoreConfig::default()).unwrap());
    start(store, ServerConfig::new("127.0.0.1:0".parse().unwrap())).unwrap()
}

fn config() -> SparseTableConfig {
    SparseTableConfig {
        dim: 4,
        optimizer: OptimizerConfig {
            lr: 1.0,
            ..OptimizerConfig::default()
        },
        initializer: Initializer::Constant(0.5),
        seed: 1,
        lifecycle: Default::default(),
        refuse_nonfinite: false,
    }
}

fn create(c: &Client, name: &str) {
    c.create_table(CreateTableRequest {
        name: name.into(),
        kind: 0,
        config_json: serde_json::to_string(&config()).unwrap(),
        stale_policy: 0,
        max_staleness: 0,
        policy_unset: false,
    })
    .unwrap();
}

#[test]
fn two_servers_hold_one_table_like_an_embedded_store() {
    let servers = [server(), server()];
    let names: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let client = Client::connect(ClientConfig::new(names)).unwrap();
    create(&client, "emb");
    let local = Store::new(StoreConfig::default()).unwrap();
    let lt = local.create_sparse_table("emb", config()).unwrap();
    let ids: Vec<u64> = (0..5000u64)
        .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .collect();
    let grads: Vec<f32> = (0..ids.len() * 4).map(|i| (i % 7) as f32 - 3.0).collect();
    client.push("emb", 4, &ids, &grads, None).unwrap();
    lt.push(&ids, &grads).unwrap();
    assert_eq!(client.pull("emb", 4, &ids).unwrap(), lt.pull(&ids).unwrap());
    let rows: Vec<u64> = servers
        .iter()
        .map(|s| s.store().unwrap().sparse("emb").unwrap().len() as u64)
        .collect();
    assert!(rows.iter().all(|&r| r > 1000), "{rows:?}");
    assert_eq!(rows.iter().sum::<u64>(), 5000);
}

#[test]
fn a_retried_push_applies_once() {
    let s = server();
    let client = Client::connect(ClientConfig::new(vec![s.addr().to_string()])).unwrap();
    create(&client, "emb");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut raw = PStoreClient::connect(format!("http://{}", s.addr()))
            .await
            .unwrap();
        let push = PushRequest {
            table: "emb".into(),
            ids: wire::encode_ids(&[7]),
            grads: wire::encode_values(&[1.0; 4], Dtype::Float32),
            dtype: 0,
            request_id: Some(RequestId { client: 9, seq: 1 }),
            pulled_seq: None,
            ..Default::default()
        };
        let first = raw.push(push.clone()).await.unwrap().into_inner();
        let again = raw.push(push.clone()).await.unwrap().into_inner();
        assert_eq!(first, again);
        let pull = PullRequest {
            table: "emb".into(),
            ids: wire::encode_ids(&[7]),
            dtype: 0,
        };
        let rows = raw.pull(pull.clone()).await.unwrap().into_inner();
        let v = wire::values(&rows.rows, Dtype::Float32, 4, "rows").unwrap();
        assert_eq!(&*v, &[-0.5; 4]);
        // Another id: applied again.
        let mut other = push;
        other.request_id = Some(RequestId { client: 9, seq: 2 });
        raw.push(other).await.unwrap();
        let rows = raw.pull(pull).await.unwrap().into_inner();
        let v = wire::values(&rows.rows, Dtype::Float32, 4, "rows").unwrap();
        assert_eq!(&*v, &[-1.5; 4]);
    });
}

#[test]
fn a_stopped_server_is_a_clear_error_within_the_timeout() {
    let mut s = server();
    let addr = s.addr().to_string();
    let mut cfg = ClientConfig::new(vec![addr.clone()]);
    cfg.timeout = Duration::from_secs(1);
    cfg.retries = 1;
    let client = Client::connect(cfg).unwrap();
    s.stop(Duration::from_secs(1)).unwrap();
    let t0 = std::time::Instant::now();
    let e = client.list_tables().unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(e.to_string().contains(&addr), "{e}");
}

/// The same code, written against `pstore::api`, over an embedded store and over two servers.
#[test]
fn the_api_traits_drive_both_stores_alike() {
    use pstore::api::{AnyTable, PushPolicy, StalePolicy, StoreApi};
    use pstore::client::ClusterStore;

    fn train(store: &dyn StoreApi) -> (Vec<f32>, u64, u64) {
        let t = store
            .create_sparse_table("emb", config(), PushPolicy::default())
            .unwrap();
        let ids: Vec<u64> = (0..300u64).map(|i| i * 7919).collect();
        let grads: Vec<f32> = (0..ids.len() * 4).map(|i| (i % 5) as f32 - 2.0).collect();
        t.push(&ids, &grads).unwrap();
        t.push_async(ids[..10].to_vec(), grads[..40].to_vec())
            .unwrap()
            .wait()
            .unwrap();
        store.flush().unwrap();
        let mut out = vec![std::mem::MaybeUninit::uninit(); ids.len() * 4];
        t.pull_into(&ids, &mut out).unwrap();
        // SAFETY: pull_into succeeded, so it wrote every element.
        let rows = out.iter().map(|x| unsafe { x.assume_init() }).collect();
        assert!(matches!(store.table("emb").unwrap(), AnyTable::Sparse(_)));
        assert_eq!(store.tables().unwrap(), ["emb"]);
        let stats = t.stats().unwrap();
        (rows, t.len().unwrap(), stats.table.ids_pushed)
    }

    let local = Store::new(StoreConfig::default()).unwrap();
    let servers = [server(), server()];
    let names: Vec<String> = servers.iter().map(|s| s.addr().to_string()).collect();
    let cluster = ClusterStore(Client::connect(ClientConfig::new(names)).unwrap());
    assert_eq!(train(&local), train(&cluster));
    let stats = match cluster.table("emb").unwrap() {
        AnyTable::Sparse(t) => t.stats().unwrap(),
        AnyTable::Dense(_) => unreachable!(),
    };
    let c = stats.cluster.expect("per-server stats");
    assert_eq!(c.servers.len(), 2);
    assert_eq!(c.servers.iter().map(|s| s.rows).sum::<u64>(), 300);
    let drop_stale = PushPolicy {
        stale_policy: StalePolicy::Drop,
        max_staleness: 1,
        given: true,
    };
    assert!(StoreApi::create_sparse_table(&local, "x", config(), drop_stale).is_err());
    cluster
        .create_sparse_table("x", config(), drop_stale)
        .unwrap();
}
