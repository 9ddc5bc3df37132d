// SPDX-License-Identifier: Apache-2.0

package opendsec

import (
	"context"
	"encoding/json"
	"net/url"
	"time"
)

// Sessions reaches a sandbox's persistent shells: the working directory, exported
// variables and shell functions carry over between the commands of one session.
type Sessions struct{ sb *Sandbox }

// Session is one persistent shell.
type Session struct {
	sb    *Sandbox
	ID    string `json:"session_id"`
	Pid   int    `json:"pid"`
	Shell string `json:"shell"`
}

// SessionOptions are a new session's working directory and environment.
type SessionOptions struct {
	Cwd string            `json:"cwd,omitempty"`
	Env map[string]string `json:"env,omitempty"`
}

// Create starts a session (o may be nil).
func (s *Sessions) Create(ctx context.Context, o *SessionOptions) (*Session, error) {
	if o == nil {
		o = &SessionOptions{}
	}
	ses := &Session{sb: s.sb}
	if err := s.sb.c.call(ctx, "POST", s.sb.base()+"/sessions", nil, o, ses, 0); err != nil {
		return nil, err
	}
	return ses, nil
}

// Get is a handle on an existing session (no request is made).
func (s *Sessions) Get(id string) *Session { return &Session{sb: s.sb, ID: id} }

// List lists the sandbox's sessions.
func (s *Sessions) List(ctx context.Context) ([]map[string]any, error) {
	var r struct {
		Sessions []map[string]any `json:"sessions"`
	}
	err := s.sb.c.call(ctx, "GET", s.sb.base()+"/sessions", nil, nil, &r, 0)
	return r.Sessions, err
}

func (s *Session) path() string { return s.sb.base() + "/sessions/" + url.PathEscape(s.ID) }

type sessionRun struct {
	Cmd        string  `json:"cmd"`
	Timeout    float64 `json:"timeout_seconds,omitempty"`
	Background bool    `json:"background,omitempty"`
}

// Run runs cmd in the shell and waits for it (timeout 0: the server's default).
func (s *Session) Run(ctx context.Context, cmd string, timeout time.Duration) (*SessionResult, error) {
	var r SessionResult
	o := ExecOptions{Timeout: timeout}
	if err := s.sb.c.call(ctx, "POST", s.path()+"/run", nil, sessionRun{Cmd: cmd, Timeout: timeout.Seconds()}, &r, o.wait()); err != nil {
		return nil, err
	}
	return &r, nil
}

// RunBackground starts cmd and returns its command id at once (see Command).
func (s *Session) RunBackground(ctx context.Context, cmd string, timeout time.Duration) (json.RawMessage, error) {
	var r SessionResult
	if err := s.sb.c.call(ctx, "POST", s.path()+"/run", nil, sessionRun{Cmd: cmd, Timeout: timeout.Seconds(), Background: true}, &r, 0); err != nil {
		return nil, err
	}
	return r.CommandID, nil
}

// Command is a background command's state: running with the output so far, or done.
func (s *Session) Command(ctx context.Context, commandID json.RawMessage) (*SessionResult, error) {
	var r SessionResult
	if err := s.sb.c.call(ctx, "GET", s.path()+"/commands/"+url.PathEscape(string(unquote(commandID))), nil, nil, &r, 0); err != nil {
		return nil, err
	}
	return &r, nil
}

func unquote(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	return string(raw)
}

// Kill ends the shell and every process it started; a session already gone is not an
// error.
func (s *Session) Kill(ctx context.Context) error {
	err := s.sb.c.call(ctx, "DELETE", s.path(), nil, nil, nil, 0)
	if err != nil && isCode(err, "not_found") {
		return nil
	}
	return err
}
