//! Table definitions follow the server list (decision 0110).
//!
//! A table created while the list changes may reach only the servers its creator knew: a
//! worker still routing by the list before a server joined, or one whose create ran between
//! `add_server`'s copy of the definitions and its publish. Three things make every server of
//! the list hold every table the cluster has, whatever the interleaving:
//!
//! - a server of this client's list that answers a call "unknown table" for a table another
//!   server of the list holds gets that table declared there, with the definition, stale policy
//!   and learning rate the other server has, and the call is sent again, the same request
//!   (with its request id: a push still applies once); see [`Client::declare_on`];
//! - `add_server` copies the definitions again after its publish (`members.rs`);
//! - a create that finds the cluster's list changed under it creates the table again over the
//!   new list (`tables.rs`).

use std::time::Duration;

use tonic::{Code, Status};

use super::{Client, Server};
use crate::net::proto::*;
use crate::net::ERROR_KIND;

/// The table a status says is unknown, if it is a server's "unknown table" refusal.
pub(super) fn unknown_table(s: &Status) -> Option<String> {
    if s.code() != Code::NotFound {
        return None;
    }
    let kind = s.metadata().get(ERROR_KIND)?;
    if kind.as_bytes() != b"unknown_table" {
        return None;
    }
    let name = s.metadata().get("pstore-table")?.to_str().ok()?;
    // A name the server shortened for its headers is not one to declare.
    (!name.contains("... (")).then(|| name.to_string())
}

/// The requests that give a server table `info` as another server has it: its definition and
/// stale policy, then its learning rate.
pub(super) fn definition_of(info: &TableInfo) -> (CreateTableRequest, SetLrRequest) {
    (
        CreateTableRequest {
            name: info.name.clone(),
            kind: info.kind,
            config_json: info.config_json.clone(),
            stale_policy: info.stale_policy,
            max_staleness: info.max_staleness,
            policy_unset: false,
        },
        SetLrRequest {
            table: info.name.clone(),
            lr: info.lr,
        },
    )
}

impl Client {
    /// Declares `table` on `server`, which answered "unknown table", when `server` is in this
    /// client's list and another server of the list holds the table: with the first holder's
    /// definition, stale policy and learning rate. True when it did (the caller sends its
    /// request again); false when no other server of the list holds the table (it is unknown
    /// to the cluster, or was dropped) or a step failed, the caller then reports the refusal.
    pub(super) async fn declare_on(&self, server: &Server, table: &str) -> bool {
        let list = self.list();
        if !list.iter().any(|s| s.name == server.name) {
            return false;
        }
        let t = self.config.timeout.min(Duration::from_secs(10));
        let asks = list.iter().filter(|s| s.name != server.name).map(|s| {
            let m = GetTableRequest {
                name: table.to_string(),
            };
            self.once(s, m, t, |mut c, r| async move { c.get_table(r).await })
        });
        let Some(info) = super::futures_join_all(asks)
            .await
            .into_iter()
            .find_map(|a| a.ok())
        else {
            return false;
        };
        let (create, lr) = definition_of(&info);
        if self
            .once(server, create, t, |mut c, r| async move {
                c.create_table(r).await
            })
            .await
            .is_err()
        {
            return false;
        }
        self.once(server, lr, t, |mut c, r| async move { c.set_lr(r).await })
            .await
            .is_ok()
    }

    /// One call to `server`'s primary, without retries or declaring (what [`declare_on`]
    /// sends: a failure there leaves the caller's own refusal to report).
    ///
    /// [`declare_on`]: Self::declare_on
    async fn once<M, R, F, Fut>(
        &self,
        server: &Server,
        msg: M,
        timeout: Duration,
        f: F,
    ) -> std::result::Result<R, Status>
    where
        F: Fn(super::Stub, tonic::Request<M>) -> Fut,
        Fut: std::future::Future<Output = std::result::Result<tonic::Response<R>, Status>>,
    {
        let g = &server.group;
        let mut req = self.request(msg, timeout);
        g.stamp(&mut req);
        let fut = f(g.primary().stub.clone(), req);
        match tokio::time::timeout(timeout + Duration::from_millis(200), fut).await {
            Ok(r) => r.map(tonic::Response::into_inner),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "no answer within {:.1} s",
                timeout.as_secs_f64()
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::net::status_of;

    #[test]
    fn only_a_servers_unknown_table_refusal_names_a_table_to_declare() {
        let s = status_of(&crate::Error::UnknownTable("emb".into()));
        assert_eq!(unknown_table(&s).as_deref(), Some("emb"));
        // Other refusals, and a name too long for the headers (shortened), are not.
        let other = status_of(&crate::Error::TableExists("emb".into()));
        assert_eq!(unknown_table(&other), None);
        assert_eq!(unknown_table(&Status::not_found("unknown table emb")), None);
        let long = "x".repeat(crate::error::MAX_NAME_BYTES + 10);
        let s = status_of(&crate::Error::UnknownTable(long));
        assert_eq!(unknown_table(&s), None);
    }

    #[test]
    fn a_definition_carries_the_holders_policy_and_learning_rate() {
        let info = TableInfo {
            name: "t".into(),
            kind: TableKind::Sparse as i32,
            config_json: "{\"dim\":4}".into(),
            stale_policy: StalePolicy::Drop as i32,
            max_staleness: 7,
            lr: 0.25,
            ..Default::default()
        };
        let (create, lr) = definition_of(&info);
        assert_eq!(create.name, "t");
        assert_eq!(create.config_json, info.config_json);
        assert_eq!(
            (create.stale_policy, create.max_staleness),
            (info.stale_policy, 7)
        );
        assert!(
            !create.policy_unset,
            "the holder's policy is set, not left to defaults"
        );
        assert_eq!((lr.table.as_str(), lr.lr), ("t", 0.25));
    }
}
