//! The request path's counter names, each a `&'static str` picked by a `match`: a request never
//! formats a stat name (no `format!`, no allocation). The names are exactly the ones the
//! families `routed.<reason>`, `rejected.<kind>`, `fallback.<why>` and
//! `tokenizer.fallback.<why>` have always had (docs/METRICS.md, tests/metrics_tags.rs); the
//! [`Host`](super::Host) takes only static names, so a formatted one does not compile.
//!
//! Each VM still defines a metric on its first use (`proxy::metrics`, once per name); after
//! that an increment is a map lookup by the static name.

use crate::render::RenderFailure;
use crate::route_error::RouteError;
use crate::router::Reason;

/// `routed.<reason>`: a request steered by a decision.
pub(super) fn routed(reason: Reason) -> &'static str {
    match reason {
        Reason::Kv => "routed.kv",
        Reason::KvTextOnly => "routed.kv-text-only",
        Reason::KvRender => "routed.kv-render",
        Reason::KvText => "routed.kv-text",
        Reason::Pinned => "routed.pinned",
        Reason::Direct => "routed.direct",
        Reason::Random => "routed.random",
        Reason::RoundRobin => "routed.round-robin",
        Reason::LeastLoaded => "routed.least-loaded",
        Reason::PowerOfTwo => "routed.power-of-two",
        Reason::DeviceAwareWeighted => "routed.device-aware-weighted",
    }
}

/// `rejected.<kind>`: a request answered locally ([`RouteError::kind`]).
pub(super) fn rejected(err: &RouteError) -> &'static str {
    match err {
        RouteError::PinRequired => "rejected.pin_required",
        RouteError::PinnedWorkerUnknown { .. } => "rejected.pinned_worker_unknown",
        RouteError::PinnedRankInvalid { .. } => "rejected.pinned_rank_invalid",
        RouteError::PinnedRankRequired { .. } => "rejected.pinned_rank_required",
        RouteError::PinnedWorkerOverloaded { .. } => "rejected.pinned_worker_overloaded",
        RouteError::AllWorkersOverloaded { .. } => "rejected.all_workers_overloaded",
        RouteError::NoCompatibleWorker { .. } => "rejected.no_compatible_worker",
        RouteError::NoWorkers => "rejected.no_workers",
        RouteError::NonFiniteCost { .. } => "rejected.non_finite_cost",
    }
}

/// `tokenizer.fallback.<why>`: a text request routed by text because the tokenizer gave no ids.
pub(super) fn tokenizer_fallback(failure: RenderFailure) -> &'static str {
    match failure {
        RenderFailure::Timeout => "tokenizer.fallback.render_timeout",
        RenderFailure::Error => "tokenizer.fallback.render_error",
        RenderFailure::BadReply => "tokenizer.fallback.render_bad_reply",
        RenderFailure::Unavailable => "tokenizer.fallback.render_unavailable",
    }
}

/// Why the filter could not decide and routed by the fallback rule (the next worker in turn).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fallback {
    BodyTooLarge,
    BodyUnreadable,
    EmptyBody,
    InvalidJson,
    InvalidField,
    NonFiniteCost,
    NoDecision,
}

impl Fallback {
    /// `fallback.<why>`.
    pub(super) fn counter(self) -> &'static str {
        match self {
            Fallback::BodyTooLarge => "fallback.body_too_large",
            Fallback::BodyUnreadable => "fallback.body_unreadable",
            Fallback::EmptyBody => "fallback.empty_body",
            Fallback::InvalidJson => "fallback.invalid_json",
            Fallback::InvalidField => "fallback.invalid_field",
            Fallback::NonFiniteCost => "fallback.non_finite_cost",
            Fallback::NoDecision => "fallback.no_decision",
        }
    }

    /// `fallback:<why>`, the value of `x-kv-router-reason`.
    pub(super) fn reason(self) -> &'static str {
        match self {
            Fallback::BodyTooLarge => "fallback:body_too_large",
            Fallback::BodyUnreadable => "fallback:body_unreadable",
            Fallback::EmptyBody => "fallback:empty_body",
            Fallback::InvalidJson => "fallback:invalid_json",
            Fallback::InvalidField => "fallback:invalid_field",
            Fallback::NonFiniteCost => "fallback:non_finite_cost",
            Fallback::NoDecision => "fallback:no_decision",
        }
    }

    /// Whether the client's body is not all here (its `priority` cannot be looked for).
    pub(super) fn body_unread(self) -> bool {
        matches!(self, Fallback::BodyTooLarge | Fallback::BodyUnreadable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The static names are the ones the families were formatted into before.
    #[test]
    fn names_are_the_formatted_ones() {
        let reasons = [
            Reason::Kv,
            Reason::KvTextOnly,
            Reason::KvRender,
            Reason::KvText,
            Reason::Pinned,
            Reason::Direct,
            Reason::Random,
            Reason::RoundRobin,
            Reason::LeastLoaded,
            Reason::PowerOfTwo,
            Reason::DeviceAwareWeighted,
        ];
        for r in reasons {
            assert_eq!(routed(r), format!("routed.{}", r.as_str()));
        }
        let errors = [
            RouteError::PinRequired,
            RouteError::PinnedWorkerUnknown { worker_id: 1 },
            RouteError::PinnedRankInvalid {
                worker_id: 1,
                dp_rank: 3,
                dp_start: 0,
                dp_size: 2,
            },
            RouteError::PinnedRankRequired {
                worker_id: 1,
                dp_start: 0,
                dp_size: 2,
            },
            RouteError::PinnedWorkerOverloaded { worker_id: 1 },
            RouteError::AllWorkersOverloaded { eligible: 0 },
            RouteError::NoCompatibleWorker {
                reason: crate::route_error::Incompatibility::NoSlotWithRank { dp_rank: 1 },
            },
            RouteError::NoWorkers,
            RouteError::NonFiniteCost { slot: 0, cost: 0.0 },
        ];
        for e in &errors {
            assert_eq!(rejected(e), format!("rejected.{}", e.kind()));
        }
        for f in [
            RenderFailure::Timeout,
            RenderFailure::Error,
            RenderFailure::BadReply,
            RenderFailure::Unavailable,
        ] {
            assert_eq!(
                tokenizer_fallback(f),
                format!("tokenizer.fallback.{}", f.as_str())
            );
        }
        for f in [
            Fallback::BodyTooLarge,
            Fallback::BodyUnreadable,
            Fallback::EmptyBody,
            Fallback::InvalidJson,
            Fallback::InvalidField,
            Fallback::NonFiniteCost,
            Fallback::NoDecision,
        ] {
            let why = f.counter().trim_start_matches("fallback.");
            assert_eq!(f.reason(), format!("fallback:{why}"));
        }
    }
}
