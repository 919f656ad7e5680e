//! The floor of any Wasm body router, as a benchmark baseline (`benches/envoy_cpu.rs`).
//!
//! Per request it does only what every body-based router inside Envoy must do: pause at the
//! headers, let Envoy buffer the body, copy the whole body into the VM once
//! (`get_http_request_body`), scan it once (count the token ids after the `"prompt"` key), and
//! set the destination header to a fixed worker. No index, no hashing, no shared data.
//!
//! Plugin configuration: `<header name> <ip:port>`, e.g.
//! `x-gateway-destination-endpoint 127.0.0.1:8000` (a plain string, so the crate needs no JSON
//! parser).

use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel};
use std::rc::Rc;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Warn);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::<FloorRoot>::default() });
}}

/// Where every request goes.
#[derive(Default)]
struct Destination {
    header: String,
    address: String,
}

#[derive(Default)]
struct FloorRoot {
    destination: Rc<Destination>,
}

impl Context for FloorRoot {}

impl RootContext for FloorRoot {
    fn on_configure(&mut self, _size: usize) -> bool {
        let text = self
            .get_plugin_configuration()
            .and_then(|b| String::from_utf8(b).ok())
            .unwrap_or_default();
        let Some((header, address)) = text.trim().split_once(' ') else {
            log::error!("floor filter: configuration must be `<header> <ip:port>`, got {text:?}");
            return false;
        };
        self.destination = Rc::new(Destination {
            header: header.to_string(),
            address: address.trim().to_string(),
        });
        true
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(FloorRequest {
            destination: Rc::clone(&self.destination),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

struct FloorRequest {
    destination: Rc<Destination>,
}

impl Context for FloorRequest {}

impl HttpContext for FloorRequest {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if end_of_stream {
            self.route(&[]);
            return Action::Continue;
        }
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, body_size).unwrap_or_default();
        self.route(&body);
        Action::Continue
    }
}

impl FloorRequest {
    fn route(&self, body: &[u8]) {
        // The one scan: the token ids after `"prompt"` (commas + 1), kept from being optimised out.
        std::hint::black_box(prompt_tokens(body));
        self.set_http_request_header(&self.destination.header, Some(&self.destination.address));
    }
}

/// Commas between `"prompt"` and the end of its array, plus one; 0 without the key.
fn prompt_tokens(body: &[u8]) -> usize {
    let key = b"\"prompt\"";
    let Some(at) = body.windows(key.len()).position(|w| w == key) else {
        return 0;
    };
    let rest = body.get(at + key.len()..).unwrap_or_default();
    let mut commas = 0;
    for &b in rest {
        match b {
            b',' => commas += 1,
            b']' => break,
            _ => {}
        }
    }
    commas + 1
}
