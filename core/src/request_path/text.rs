//! A text prompt in KV mode: the cached render, else a tokenizer callout (the request pauses
//! until it answers), else the text's prefix hashes (approximate mode).

use super::context::{Action, PendingRender, RequestPath};
use super::counters;
use super::host::Host;
use super::state::RoutingState;
use crate::config::Config;
use crate::prompt_text::{render_cache_key, text_prefix_hashes};
use crate::render::{classify, parse_reply, RenderFailure};
use crate::request::{Endpoint, LlmRequest};
use std::rc::Rc;
use std::time::Duration;

impl RequestPath {
    /// A text request: the cached render, else a tokenizer call (pauses), else text hashes.
    #[allow(clippy::too_many_arguments)] // the request's parts, as the parse left them
    pub(super) fn route_text(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        config: &Config,
        mut request: LlmRequest,
        text: String,
        endpoint: Endpoint,
        body: &[u8],
    ) -> Action {
        let Some(tokenizer) = &config.tokenizer else {
            return self.route_by_text(host, vm, config, request, &text, None);
        };
        let cache_key = render_cache_key(
            endpoint,
            request.model.as_deref(),
            request.lora_name.as_deref(),
            &text,
        );
        if let Some(ids) = vm.render_cache.get(cache_key) {
            host.count("tokenizer.cache_hit", 1);
            request.token_ids = Some(ids.as_ref().clone());
            request.rendered = true;
            return self.decide_known_ids(host, vm, config, request, None, None);
        }
        host.count("tokenizer.cache_miss", 1);
        let path = match endpoint {
            Endpoint::ChatCompletions => tokenizer.chat_path.as_str(),
            Endpoint::Completions => tokenizer.completions_path.as_str(),
        };
        let authority = if tokenizer.address.is_empty() {
            tokenizer.cluster.as_str()
        } else {
            tokenizer.address.as_str()
        };
        let headers = [
            (":method", "POST"),
            (":path", path),
            (":authority", authority),
            (":scheme", "http"),
            ("content-type", "application/json"),
            ("x-envoy-original-dst-host", authority),
        ];
        // The original destination only when the tokenizer has an address of its own.
        let headers = if tokenizer.address.is_empty() {
            headers.get(..5).unwrap_or(&headers)
        } else {
            headers.as_slice()
        };
        let timeout = Duration::from_millis(tokenizer.timeout_ms);
        match host.dispatch_call(&tokenizer.cluster, headers, body, timeout) {
            Some(token) => {
                host.count("tokenizer.calls", 1);
                self.render = Some(PendingRender {
                    token,
                    request,
                    text,
                    cache_key,
                    started_ms: host.now_ms(),
                });
                Action::Pause
            }
            None => self.route_by_text(
                host,
                vm,
                config,
                request,
                &text,
                Some(RenderFailure::Unavailable),
            ),
        }
    }

    /// Routes a text request by its text prefix hashes (approximate mode), or on load alone
    /// without it; `failure` says why the tokenizer gave no ids (header and counter).
    fn route_by_text(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        config: &Config,
        mut request: LlmRequest,
        text: &str,
        failure: Option<RenderFailure>,
    ) -> Action {
        if let Some(f) = failure {
            host.count(counters::tokenizer_fallback(f), 1);
        }
        let hashes = config.approximate.as_ref().map(|a| {
            text_prefix_hashes(
                text,
                a.text_chunk_bytes,
                request.lora_name.as_deref(),
                a.max_record_blocks,
            )
        });
        request.text_prefix = hashes.is_some();
        self.decide_known_ids(
            host,
            vm,
            config,
            request,
            hashes,
            failure.map(RenderFailure::as_str),
        )
    }

    /// The tokenizer answered (or the call failed): route with its ids, else by text; resume.
    pub(super) fn render_done(
        &mut self,
        host: &mut impl Host,
        vm: &mut RoutingState,
        token: u32,
        num_headers: usize,
        body_size: usize,
    ) {
        if self.render.as_ref().is_none_or(|p| p.token != token) {
            return;
        }
        let Some(pending) = self.render.take() else {
            return;
        };
        let config = Rc::clone(&vm.config);
        let elapsed_ms = host.now_ms().saturating_sub(pending.started_ms);
        host.histogram("tokenizer.render_ms", elapsed_ms);
        let status = if num_headers == 0 {
            None
        } else {
            host.call_response_status()
        };
        let max_bytes = config
            .tokenizer
            .as_ref()
            .map_or(0, |t| t.max_response_bytes);
        let timeout_ms = config.tokenizer.as_ref().map_or(0, |t| t.timeout_ms);
        let ids = classify(status.as_deref(), body_size, max_bytes)
            .and_then(|()| {
                host.call_response_body(body_size)
                    .ok_or(RenderFailure::BadReply)
            })
            .and_then(|body| parse_reply(&body))
            .map_err(|f| {
                // Envoy ends a call that ran out of time without a response.
                if f == RenderFailure::Error && status.is_none() && elapsed_ms >= timeout_ms {
                    RenderFailure::Timeout
                } else {
                    f
                }
            });
        let mut request = pending.request;
        let action = match ids {
            Ok(ids) => {
                host.count("tokenizer.rendered", 1);
                let ids = Rc::new(ids);
                request.token_ids = Some(ids.as_ref().clone());
                request.rendered = true;
                vm.render_cache.insert(pending.cache_key, ids);
                self.decide_known_ids(host, vm, &config, request, None, None)
            }
            Err(f) => {
                log::debug!(
                    "kv-router: tokenizer call failed ({}); routing by text",
                    f.as_str()
                );
                self.route_by_text(host, vm, &config, request, &pending.text, Some(f))
            }
        };
        // A local reply (a rejection) already ended the stream.
        if action == Action::Continue {
            self.drop_client_destination(host, &vm.config);
            host.resume_request();
        }
    }
}
