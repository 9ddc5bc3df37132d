// SPDX-License-Identifier: Apache-2.0

package opendsec

import (
	"context"
	"encoding/json"
	"net/url"
	"strconv"
	"time"
)

// Event is one thing that happened to a sandbox: Type is "created", "paused", "resumed",
// "updated", "forked", "snapshotted", "stopped", "expired" or "oom_killed".
type Event struct {
	ID      string                     `json:"id"`
	Seq     uint64                     `json:"seq"`
	Type    string                     `json:"type"`
	AtMs    uint64                     `json:"at_ms"`
	Sandbox string                     `json:"sandbox"`
	Project string                     `json:"project"`
	Edge    string                     `json:"edge"`
	Backend string                     `json:"backend"`
	Reason  string                     `json:"reason,omitempty"`
	Labels  map[string]string          `json:"labels,omitempty"`
	Detail  map[string]json.RawMessage `json:"detail,omitempty"`
}

// EventsQuery selects events: those with Seq over After (the previous answer's Next),
// at most Limit (0: 100), of one Sandbox and one Type when set (or any of Types).
// NewestFirst turns the order round; Offset passes over that many matches first. Wait
// (at most a minute) waits for one when there is none yet.
type EventsQuery struct {
	After       uint64
	Limit       int
	Sandbox     string
	Type        string
	Types       []string
	NewestFirst bool
	Offset      int
	Wait        time.Duration
}

// Events lists the lifecycle events of the key's sandboxes (its project and the projects
// inside it), oldest first, and the After of the next page.
func (c *Client) Events(ctx context.Context, q EventsQuery) ([]Event, uint64, error) {
	v := url.Values{"after": {strconv.FormatUint(q.After, 10)}}
	if q.Limit > 0 {
		v.Set("limit", strconv.Itoa(q.Limit))
	}
	if q.Sandbox != "" {
		v.Set("sandbox", q.Sandbox)
	}
	if q.Type != "" {
		v.Add("type", q.Type)
	}
	for _, t := range q.Types {
		v.Add("type", t)
	}
	if q.NewestFirst {
		v.Set("order", "desc")
	}
	if q.Offset > 0 {
		v.Set("offset", strconv.Itoa(q.Offset))
	}
	if q.Wait > 0 {
		v.Set("wait_seconds", strconv.FormatFloat(q.Wait.Seconds(), 'f', 3, 64))
	}
	var r struct {
		Events []Event `json:"events"`
		Next   uint64  `json:"next"`
	}
	if err := c.call(ctx, "GET", "/v1/events", v, nil, &r, q.Wait); err != nil {
		return nil, q.After, err
	}
	return r.Events, r.Next, nil
}

// Webhook sends a project's events to a URL. Secret, the key of each delivery's
// X-Dsec-Signature (t=<unix>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>), is set only
// in CreateWebhook's answer.
type Webhook struct {
	ID          string   `json:"id"`
	URL         string   `json:"url"`
	Project     string   `json:"project"`
	Types       []string `json:"types,omitempty"`
	CreatedAtMs uint64   `json:"created_at_ms"`
	Secret      string   `json:"secret,omitempty"`
	Name        string   `json:"name,omitempty"`
	// Enabled: whether events are sent to it.
	Enabled bool `json:"enabled"`
	// Format: "dsec", or "e2b" for a webhook made through the E2B gateway (E2B's
	// bodies and signature).
	Format string `json:"format"`
}

// WebhookUpdate says what UpdateWebhook changes; a nil field stays as it is (Types set
// to an empty slice: every type).
type WebhookUpdate struct {
	URL     *string   `json:"url,omitempty"`
	Types   *[]string `json:"types,omitempty"`
	Name    *string   `json:"name,omitempty"`
	Enabled *bool     `json:"enabled,omitempty"`
}

// UpdateWebhook changes a webhook's URL, types, name or whether it is sent events.
func (c *Client) UpdateWebhook(ctx context.Context, id string, u WebhookUpdate) (*Webhook, error) {
	var w Webhook
	if err := c.call(ctx, "PATCH", "/v1/webhooks/"+url.PathEscape(id), nil, u, &w, 0); err != nil {
		return nil, err
	}
	return &w, nil
}

// CreateWebhook sends the events of project (default: the key's, with its sub-projects)
// of the given types (none: all) to url, one POST per event, in order, retried with
// backoff.
func (c *Client) CreateWebhook(ctx context.Context, url string, types []string, project string) (*Webhook, error) {
	body := map[string]any{"url": url}
	if len(types) > 0 {
		body["types"] = types
	}
	if project != "" {
		body["project"] = project
	}
	var w Webhook
	if err := c.call(ctx, "POST", "/v1/webhooks", nil, body, &w, 0); err != nil {
		return nil, err
	}
	return &w, nil
}

// Webhooks lists the webhooks the key can see (without their secrets).
func (c *Client) Webhooks(ctx context.Context) ([]Webhook, error) {
	var r struct {
		Webhooks []Webhook `json:"webhooks"`
	}
	err := c.call(ctx, "GET", "/v1/webhooks", nil, nil, &r, 0)
	return r.Webhooks, err
}

// DeleteWebhook removes a webhook.
func (c *Client) DeleteWebhook(ctx context.Context, id string) error {
	return c.call(ctx, "DELETE", "/v1/webhooks/"+url.PathEscape(id), nil, nil, nil, 0)
}
