// SPDX-License-Identifier: Apache-2.0

package opendsec

import (
	"context"
	"net/url"
)

// Whoami describes the client's key: its principal and project.
func (c *Client) Whoami(ctx context.Context) (map[string]any, error) {
	var r map[string]any
	err := c.call(ctx, "GET", "/v1/whoami", nil, nil, &r, 0)
	return r, err
}

// Project is a project with its quota and usage.
type Project struct {
	Path  string         `json:"path"`
	Quota map[string]any `json:"quota"`
	Usage map[string]any `json:"usage"`
}

// CreateProject creates project (e.g. "root/team-a/exp-1") with a quota delegated from
// its parent.
func (c *Client) CreateProject(ctx context.Context, project string, quota Quota) (*Project, error) {
	var r Project
	if err := c.call(ctx, "POST", "/v1/projects", nil, map[string]any{"project": project, "quota": quota}, &r, 0); err != nil {
		return nil, err
	}
	return &r, nil
}

// SetQuota sets a project's quota; only a key of a parent project can.
func (c *Client) SetQuota(ctx context.Context, project string, quota Quota) (*Project, error) {
	var r Project
	if err := c.call(ctx, "POST", "/v1/projects/quota", nil, map[string]any{"project": project, "quota": quota}, &r, 0); err != nil {
		return nil, err
	}
	return &r, nil
}

// Projects lists the projects the key can see.
func (c *Client) Projects(ctx context.Context) ([]Project, error) {
	var r struct {
		Projects []Project `json:"projects"`
	}
	err := c.call(ctx, "GET", "/v1/projects", nil, nil, &r, 0)
	return r.Projects, err
}

// KeyOptions are CreateKey's optional settings.
type KeyOptions struct {
	// Project is the key's project (default: the client key's).
	Project string
	// Agent makes a key for an agent rather than a person.
	Agent bool
	// E2BFormat makes the key in E2B's shape ("e2b_" and 40 hex digits).
	E2BFormat bool
}

// CreateKey makes an API key for principal; its Secret is shown only in this answer.
func (c *Client) CreateKey(ctx context.Context, principal string, o *KeyOptions) (*Key, error) {
	body := map[string]any{"principal": principal, "kind": "human"}
	if o != nil {
		if o.Project != "" {
			body["project"] = o.Project
		}
		if o.Agent {
			body["kind"] = "agent"
		}
		if o.E2BFormat {
			body["format"] = "e2b"
		}
	}
	var k Key
	if err := c.call(ctx, "POST", "/v1/keys", nil, body, &k, 0); err != nil {
		return nil, err
	}
	return &k, nil
}

// Keys lists the keys of the projects the key can see (ids, never the keys).
func (c *Client) Keys(ctx context.Context) ([]Key, error) {
	var r struct {
		Keys []Key `json:"keys"`
	}
	err := c.call(ctx, "GET", "/v1/keys", nil, nil, &r, 0)
	return r.Keys, err
}

// RevokeKey revokes a key by id.
func (c *Client) RevokeKey(ctx context.Context, keyID string) error {
	return c.call(ctx, "DELETE", "/v1/keys/"+url.PathEscape(keyID), nil, nil, nil, 0)
}
