//! One context per HTTP request: forwards each callback to the host-independent request path
//! ([`crate::request_path::RequestPath`]) with the real host ([`EnvoyHost`]) and the VM's
//! routing state, and counts the host calls of each (`count-host-calls` builds).

use super::envoy_host::EnvoyHost;
use super::host::{self, HostStore};
use super::vm::VmState;
use crate::request_path::{Action as PathAction, RequestPath, RoutingState};
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::Action;
use std::cell::RefCell;
use std::rc::Rc;

pub struct RequestContext {
    vm: Rc<RefCell<VmState>>,
    request: RequestPath,
    /// Host calls made by this request's callbacks (`count-host-calls` builds; 0 otherwise).
    host_calls: u64,
}

impl RequestContext {
    pub fn new(vm: Rc<RefCell<VmState>>) -> Self {
        RequestContext {
            vm,
            request: RequestPath::new(),
            host_calls: 0,
        }
    }

    /// Runs `f` with the request, the real host and the VM's routing state; `unavailable` when
    /// the VM state is borrowed already (never expected: callbacks do not nest).
    fn with_host<R>(
        &mut self,
        unavailable: R,
        f: impl FnOnce(&mut RequestPath, &mut EnvoyHost<'_>, &mut RoutingState) -> R,
    ) -> R {
        let mark = host::calls();
        let result = match self.vm.try_borrow_mut() {
            Ok(mut guard) => {
                let VmState {
                    path,
                    metrics,
                    histogram_ids,
                    ..
                } = &mut *guard;
                let mut host = EnvoyHost {
                    metrics,
                    histograms: histogram_ids,
                };
                f(&mut self.request, &mut host, path)
            }
            Err(_) => unavailable,
        };
        self.host_calls += host::calls().saturating_sub(mark);
        result
    }

    /// `debug.host_calls` and `debug.requests` (the `count-host-calls` build only): the host
    /// calls of every callback of this request's context, for the benchmarks.
    fn flush_host_calls(&mut self) {
        #[cfg(feature = "count-host-calls")]
        if let Ok(mut vm) = self.vm.try_borrow_mut() {
            vm.metrics.add("debug.host_calls", self.host_calls);
            vm.metrics.inc("debug.requests");
        }
    }
}

fn action(action: PathAction) -> Action {
    match action {
        PathAction::Continue => Action::Continue,
        PathAction::Pause => Action::Pause,
    }
}

impl Context for RequestContext {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        let handled = self.with_host(false, |request, host, vm| {
            request.on_call_response(host, vm, token_id, num_headers, body_size);
            true
        });
        if !handled {
            let _ = host::resume_request();
        }
    }
}

impl HttpContext for RequestContext {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        #[cfg(feature = "test-crash-trigger")]
        crate::proxy::crash_trigger::trap_if_asked();
        action(self.with_host(PathAction::Continue, |request, host, vm| {
            request.on_request_headers(host, vm, end_of_stream)
        }))
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.with_host(PathAction::Continue, |request, host, vm| {
            request.on_request_body(host, vm, body_size, end_of_stream)
        }))
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        action(self.with_host(PathAction::Continue, |request, host, vm| {
            let config = Rc::clone(&vm.config);
            request.on_request_trailers(host, &config)
        }))
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        action(self.with_host(PathAction::Continue, |request, host, vm| {
            request.on_response_headers(host, vm, end_of_stream)
        }))
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        action(self.with_host(PathAction::Continue, |request, host, vm| {
            request.on_response_body(host, vm, body_size, end_of_stream)
        }))
    }

    fn on_log(&mut self) {
        let logged = self.with_host(false, |request, host, vm| {
            request.on_log(host, vm);
            true
        });
        if !logged {
            // Release without the VM's deferral queue rather than leave phantom load.
            let slots = self
                .vm
                .try_borrow()
                .map_or(0, |vm| vm.path.config.slots.len());
            if slots > 0 {
                self.request
                    .release_without_state(&HostStore, slots, host::now_ms());
            }
        }
        self.flush_host_calls();
    }
}
