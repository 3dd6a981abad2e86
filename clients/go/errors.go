// SPDX-License-Identifier: Apache-2.0

package kvmatch

import "fmt"

// Code is a km_status code (include/kvmatch/error.h): 0 is success, a negative value a failure.
// A decision's or ACK item's Status and an ERROR reply's code are Codes. A Code is an error, so
// errors.Is(err, kvmatch.ErrNotFound) tells what failed whatever wrapped it.
type Code int

// Every km_status code, under its name in include/kvmatch/error.h.
const (
	OK                    Code = 0
	ErrInvalidArgument    Code = -1
	ErrNullPointer        Code = -2
	ErrBlockSize          Code = -3
	ErrWorkerRange        Code = -4
	ErrOutOfMemory        Code = -5
	ErrMemoryCap          Code = -6
	ErrTooLarge           Code = -7
	ErrParse              Code = -8
	ErrBackendUnavailable Code = -9
	ErrCUDA               Code = -10
	ErrIO                 Code = -11
	ErrInternal           Code = -12
	ErrCorrupt            Code = -13
	ErrIncompatible       Code = -14
	ErrNotFound           Code = -15
	ErrProtocol           Code = -16
	ErrOverloaded         Code = -17
	ErrShuttingDown       Code = -18
	ErrTimeout            Code = -19
	ErrClosed             Code = -20
	ErrNoHealthyWorker    Code = -21
)

// CodeNames maps every Code this client knows to its km_status name.
var CodeNames = map[Code]string{
	OK:                    "KM_OK",
	ErrInvalidArgument:    "KM_ERR_INVALID_ARGUMENT",
	ErrNullPointer:        "KM_ERR_NULL_POINTER",
	ErrBlockSize:          "KM_ERR_BLOCK_SIZE",
	ErrWorkerRange:        "KM_ERR_WORKER_RANGE",
	ErrOutOfMemory:        "KM_ERR_OUT_OF_MEMORY",
	ErrMemoryCap:          "KM_ERR_MEMORY_CAP",
	ErrTooLarge:           "KM_ERR_TOO_LARGE",
	ErrParse:              "KM_ERR_PARSE",
	ErrBackendUnavailable: "KM_ERR_BACKEND_UNAVAILABLE",
	ErrCUDA:               "KM_ERR_CUDA",
	ErrIO:                 "KM_ERR_IO",
	ErrInternal:           "KM_ERR_INTERNAL",
	ErrCorrupt:            "KM_ERR_CORRUPT",
	ErrIncompatible:       "KM_ERR_INCOMPATIBLE",
	ErrNotFound:           "KM_ERR_NOT_FOUND",
	ErrProtocol:           "KM_ERR_PROTOCOL",
	ErrOverloaded:         "KM_ERR_OVERLOADED",
	ErrShuttingDown:       "KM_ERR_SHUTTING_DOWN",
	ErrTimeout:            "KM_ERR_TIMEOUT",
	ErrClosed:             "KM_ERR_CLOSED",
	ErrNoHealthyWorker:    "KM_ERR_NO_HEALTHY_WORKER",
}

// Name is the code's km_status name, or KM_ERR_UNKNOWN(<code>) for one this client does not know
// (a newer server).
func (c Code) Name() string {
	if name, ok := CodeNames[c]; ok {
		return name
	}
	return fmt.Sprintf("KM_ERR_UNKNOWN(%d)", int(c))
}

func (c Code) Error() string { return c.Name() }

// Error is a failure with its Code and the sentence that says what failed: an ERROR reply (the
// server's words), a decision or ACK item that failed, or the client's own refusal of a reply.
type Error struct {
	Code    Code
	Message string
}

func (e *Error) Error() string {
	if e.Message == "" {
		return e.Code.Name()
	}
	return e.Code.Name() + ": " + e.Message
}

// Unwrap gives the Code, for errors.Is(err, kvmatch.ErrNotFound).
func (e *Error) Unwrap() error { return e.Code }

func newError(code Code, format string, args ...interface{}) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// statusError is nil for OK, else the item's failure. The server words the messages its decoder
// writes as "KM_ERR_NAME: detail": the name is said once.
func statusError(status Code, message string) error {
	if status == OK {
		return nil
	}
	return &Error{Code: status, Message: serverWords(status, message)}
}

func serverWords(code Code, message string) string {
	prefix := code.Name() + ": "
	if len(message) >= len(prefix) && message[:len(prefix)] == prefix {
		return message[len(prefix):]
	}
	return message
}

// OutcomeFromStream is the outcome rule of docs/PROTOCOL.md: "error" when an error was seen or
// the HTTP status is known (non-zero) and not 2xx; else "complete" only when the final
// finish_reason and the [DONE] sentinel were both seen; else "incomplete", even with HTTP 200.
func OutcomeFromStream(finishReason string, doneSeen bool, httpStatus uint32, errorSeen string) string {
	if errorSeen != "" || (httpStatus != 0 && (httpStatus < 200 || httpStatus > 299)) {
		return "error"
	}
	if finishReason != "" && doneSeen {
		return "complete"
	}
	return "incomplete"
}
