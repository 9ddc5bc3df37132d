// SPDX-License-Identifier: Apache-2.0

package opendsec

import (
	"encoding/json"
	"fmt"
)

// Error is a failed API call: the server's machine-readable Code, a Message that says
// what to fix, and the HTTP Status it came with. Compare it with the Err* values:
//
//	if errors.Is(err, opendsec.ErrNotFound) { ... }
//
// or take the details with errors.As:
//
//	var e *opendsec.Error
//	if errors.As(err, &e) { log.Print(e.Code, e.Message) }
type Error struct {
	Status  int
	Code    string
	Message string
	// Err is the transport error behind an "unavailable" Error made by this client.
	Err error
}

func (e *Error) Error() string {
	if e.Message == "" {
		return e.Code
	}
	return e.Code + ": " + e.Message
}

func (e *Error) Unwrap() error { return e.Err }

// Is matches an Error with the same Code: errors.Is(err, ErrNotFound).
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Code == e.Code && (t.Message == "" || t.Message == e.Message)
}

// The API's error codes, for errors.Is. Each is answered with the HTTP status beside it.
var (
	ErrInvalidArgument    = &Error{Code: "invalid_argument", Status: 400}
	ErrUnauthenticated    = &Error{Code: "unauthenticated", Status: 401}
	ErrPermissionDenied   = &Error{Code: "permission_denied", Status: 403}
	ErrNotFound           = &Error{Code: "not_found", Status: 404}
	ErrAlreadyExists      = &Error{Code: "already_exists", Status: 409}
	ErrFailedPrecondition = &Error{Code: "failed_precondition", Status: 409}
	ErrResourceExhausted  = &Error{Code: "resource_exhausted", Status: 429}
	ErrInternal           = &Error{Code: "internal", Status: 500}
	ErrUnimplemented      = &Error{Code: "unimplemented", Status: 501}
	ErrUnavailable        = &Error{Code: "unavailable", Status: 503}
	ErrDeadlineExceeded   = &Error{Code: "deadline_exceeded", Status: 504}
)

var statusOfCode = map[string]int{}

func init() {
	for _, e := range []*Error{ErrInvalidArgument, ErrUnauthenticated, ErrPermissionDenied, ErrNotFound,
		ErrAlreadyExists, ErrFailedPrecondition, ErrResourceExhausted, ErrInternal, ErrUnimplemented,
		ErrUnavailable, ErrDeadlineExceeded} {
		statusOfCode[e.Code] = e.Status
	}
}

// errorFromBody turns an error answer ({"code", "message"}) into an *Error; a body that
// is not one (a proxy's page, say) becomes code "http_error" with the start of the body.
func errorFromBody(status int, body []byte) *Error {
	var b struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	if err := json.Unmarshal(body, &b); err == nil && b.Code != "" {
		return &Error{Status: status, Code: b.Code, Message: b.Message}
	}
	if len(body) > 200 {
		body = body[:200]
	}
	return &Error{Status: status, Code: "http_error", Message: fmt.Sprintf("HTTP %d: %q", status, body)}
}

// errorFromEvent is the *Error of an {"type": "error", "code", "message"} stream event.
func errorFromEvent(code, message string) *Error {
	if code == "" {
		code = "internal"
	}
	return &Error{Status: statusOfCode[code], Code: code, Message: message}
}
