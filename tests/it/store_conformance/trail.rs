//! Conformance of `Trail`: the audit row every resolution leaves, and the
//! trail read back, on every backend.

use idemgate::idempotency::record::Retention;
use idemgate::idempotency::record::{State, TransitionError};
use idemgate::store::audit::{Actor, AuditNote};
use idemgate::store::{Resolution, ResolveOutcome};

use super::{LONG, RELEASE, claim, get, key, note, open, req, response, row};
use crate::support::{self, Backend};

on_both_stores!(resolve_of_a_completed_record_needs_force_and_is_audited);

on_pgbouncer!(resolve_of_a_completed_record_needs_force_and_is_audited);

on_citus!(resolve_of_a_completed_record_needs_force_and_is_audited);

/// A completed record is the answer every retry is replayed: releasing it
/// lets the next retry execute again. Only `force` (with a reason, which the
/// CLI and API demand) changes it, and every resolution leaves an audit row
/// in the same transaction.
async fn resolve_of_a_completed_record_needs_force_and_is_audited(backend: Backend) {
    let store = open(&backend).await;
    let done = key("done");
    let c = claim(&store, &req(&done, 1, LONG, false)).await;
    store.complete(&c, &response(201, b"order 1"), Retention::For(LONG)).await.unwrap();
    let before = row(&store, &done).await;
    let plain = note("looks wrong");
    assert_eq!(
        store.resolve(&done, &RELEASE, &plain).await.unwrap(),
        ResolveOutcome::Refused(TransitionError::NotAllowed(State::Completed))
    );
    let complete = Resolution::Complete { response: response(200, b"other"), retention: Retention::For(LONG), force: false };
    assert_eq!(
        store.resolve(&done, &complete, &plain).await.unwrap(),
        ResolveOutcome::Refused(TransitionError::NotAllowed(State::Completed))
    );
    assert_eq!(row(&store, &done).await, before, "nothing changed");
    assert!(store.audit(10).await.unwrap().is_empty(), "refusals leave no audit row");

    let forced = AuditNote { actor: Actor::Admin, reason: "customer refunded by hand".into(), forced: true, caller: None };
    let fix = Resolution::Complete { response: response(200, b"corrected"), retention: Retention::For(LONG), force: true };
    assert_eq!(store.resolve(&done, &fix, &forced).await.unwrap(), ResolveOutcome::Resolved { from: State::Completed });
    let fixed = row(&store, &done).await;
    assert_eq!(fixed.response, Some(response(200, b"corrected")));
    assert_eq!(
        store.resolve(&done, &Resolution::Release { force: true }, &forced).await.unwrap(),
        ResolveOutcome::Resolved { from: State::Completed }
    );
    assert_eq!(get(&store, &done).await, None);

    // An unknown record resolved by the reconciler, for the trail's variety.
    let u = key("unknown");
    let uc = claim(&store, &req(&u, 1, LONG, false)).await;
    store.mark_unknown(&uc).await.unwrap();
    let by_probe = AuditNote { actor: Actor::Reconciler, reason: "probe: 404".into(), forced: false, caller: None };
    assert_eq!(store.resolve(&u, &RELEASE, &by_probe).await.unwrap(), ResolveOutcome::Resolved { from: State::Unknown });

    let trail = store.audit(10).await.unwrap();
    let summary: Vec<_> =
        trail.iter().map(|a| (a.actor.as_str(), a.scope.key.as_str(), a.from_state.as_str(), a.to_state.as_str(), a.forced)).collect();
    assert_eq!(
        summary,
        vec![
            ("reconciler", "unknown", "unknown", "released", false),
            ("admin", "done", "completed", "released", true),
            ("admin", "done", "completed", "completed", true),
        ],
        "newest first"
    );
    assert_eq!(trail[2].generation, Some(fixed.generation));
    assert_eq!(trail[1].generation, None);
    assert_eq!(trail[1].reason, "customer refunded by hand");
    assert_eq!(trail[0].scope, u);
    assert!(trail[0].at >= trail[2].at);
    assert_eq!(store.audit(1).await.unwrap().len(), 1, "limit applies");
}
