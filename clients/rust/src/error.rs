// SPDX-License-Identifier: Apache-2.0
//! km_status codes and the client's error type.

use std::fmt;

/// A km_status code (include/kvmatch/error.h): 0 is success, a negative value a failure. A
/// decision's or ACK item's `status` and an ERROR reply's `code` are codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Code(pub i64);

macro_rules! codes {
    ($($name:ident = $value:expr, $wire:expr;)*) => {
        impl Code {
            $(pub const $name: Code = Code($value);)*
            /// Every code this client knows, with its km_status name.
            pub const ALL: &'static [(Code, &'static str)] = &[$((Code($value), $wire)),*];
        }
    };
}

codes! {
    OK = 0, "KM_OK";
    INVALID_ARGUMENT = -1, "KM_ERR_INVALID_ARGUMENT";
    NULL_POINTER = -2, "KM_ERR_NULL_POINTER";
    BLOCK_SIZE = -3, "KM_ERR_BLOCK_SIZE";
    WORKER_RANGE = -4, "KM_ERR_WORKER_RANGE";
    OUT_OF_MEMORY = -5, "KM_ERR_OUT_OF_MEMORY";
    MEMORY_CAP = -6, "KM_ERR_MEMORY_CAP";
    TOO_LARGE = -7, "KM_ERR_TOO_LARGE";
    PARSE = -8, "KM_ERR_PARSE";
    BACKEND_UNAVAILABLE = -9, "KM_ERR_BACKEND_UNAVAILABLE";
    CUDA = -10, "KM_ERR_CUDA";
    IO = -11, "KM_ERR_IO";
    INTERNAL = -12, "KM_ERR_INTERNAL";
    CORRUPT = -13, "KM_ERR_CORRUPT";
    INCOMPATIBLE = -14, "KM_ERR_INCOMPATIBLE";
    NOT_FOUND = -15, "KM_ERR_NOT_FOUND";
    PROTOCOL = -16, "KM_ERR_PROTOCOL";
    OVERLOADED = -17, "KM_ERR_OVERLOADED";
    SHUTTING_DOWN = -18, "KM_ERR_SHUTTING_DOWN";
    TIMEOUT = -19, "KM_ERR_TIMEOUT";
    CLOSED = -20, "KM_ERR_CLOSED";
    NO_HEALTHY_WORKER = -21, "KM_ERR_NO_HEALTHY_WORKER";
}

impl Code {
    /// The km_status name, or `KM_ERR_UNKNOWN(<code>)` for a code this client does not know (a
    /// newer server).
    pub fn name(self) -> String {
        match Code::ALL.iter().find(|(c, _)| *c == self) {
            Some((_, name)) => (*name).to_string(),
            None => format!("KM_ERR_UNKNOWN({})", self.0),
        }
    }

    pub fn is_ok(self) -> bool {
        self == Code::OK
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// A failure: its code and the sentence that says what failed (an ERROR reply's words, a failed
/// decision or ACK item, or the client's own refusal of a reply or of a request it will not send).
#[derive(Clone, Debug, PartialEq)]
pub struct Error {
    pub code: Code,
    pub message: String,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Error {
        Error { code, message: message.into() }
    }

    /// An item's or reply's failure in the server's words, less a leading "KM_ERR_NAME: " of its
    /// own code (the server words what its decoder refused that way), since Display names it.
    pub(crate) fn from_server(code: Code, message: &str) -> Error {
        let prefix = format!("{}: ", code.name());
        let words = message.strip_prefix(prefix.as_str()).unwrap_or(message);
        Error::new(code, words)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "{}", self.code)
        } else {
            write!(f, "{}: {}", self.code, self.message)
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// The outcome rule of docs/PROTOCOL.md: "error" when an error was seen or the HTTP status is
/// known and not 2xx; else "complete" only when the final finish_reason and the [DONE] sentinel
/// were both seen; else "incomplete", even with HTTP 200.
pub fn outcome_from_stream(
    finish_reason: Option<&str>,
    done_seen: bool,
    http_status: Option<u32>,
    error: Option<&str>,
) -> &'static str {
    let failed_status = matches!(http_status, Some(s) if !(200..=299).contains(&s));
    if error.map_or(false, |e| !e.is_empty()) || failed_status {
        "error"
    } else if finish_reason.map_or(false, |r| !r.is_empty()) && done_seen {
        "complete"
    } else {
        "incomplete"
    }
}
