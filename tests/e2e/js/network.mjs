// SPDX-License-Identifier: AGPL-3.0-only
// The released `e2b` npm package against the E2B gateway of test_network's lab node (whose
// echo servers answer with the headers they got): `network.rules` transforms, the network
// in `getInfo` (with E2B's default DNS server opened, as the package has no `dnsServers`),
// and `updateNetwork`.
// Usage: node network.mjs <template> <other-ip>   (prints "ok network")
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'

import { Sandbox } from 'e2b'

const [template, otherIp] = process.argv.slice(2)

// GET / by hand inside the sandbox (../fetch_probe.py): [where, port, host, sni, cafile, tls]
// → the echo's JSON or "FAIL …"
const FETCH = readFileSync(new URL('../fetch_probe.py', import.meta.url), 'utf8')

async function fetch(sb, ...checks) {
  const r = await sb.commands.run(`python3 /tmp/fetch.py '${JSON.stringify(checks)}'`, { timeoutMs: 120_000 })
  return JSON.parse(r.stdout).map((v) => (typeof v === 'string' ? v : v.headers['x-secret']))
}

const made = []
try {
  const sb = await Sandbox.create(template, {
    timeoutMs: 300_000,
    network: {
      allowOut: ['pypi.test', 'files.pypi.test'],
      denyOut: ['0.0.0.0/0'],
      rules: {
        'pypi.test': [{ transform: { headers: { 'X-Secret': 'js-exact' } } }],
        '*.pypi.test': [{ transform: () => ({ headers: { 'X-Secret': 'js-wild' } }) }],
      },
    },
  })
  made.push(sb)
  await sb.files.write('/tmp/fetch.py', FETCH)
  assert.deepEqual(
    await fetch(sb, ['pypi.test', 443, 'pypi.test', null, null, true], ['pypi.test', 80, 'pypi.test'],
      ['files.pypi.test', 443, 'files.pypi.test', null, null, true]),
    ['js-exact', 'js-exact', 'js-wild'],
  )
  const info = await sb.getInfo()
  assert.deepEqual(info.network?.rules?.['pypi.test']?.[0]?.transform?.headers, { 'X-Secret': 'js-exact' },
    JSON.stringify(info.network))
  // E2B's default DNS server is opened, since allowOut names a domain
  assert.ok(info.network?.allowOut?.includes('8.8.8.8'), JSON.stringify(info.network))

  await sb.updateNetwork({ allowOut: ['pypi.test'], denyOut: ['0.0.0.0/0'],
    rules: { 'pypi.test': [{ transform: { headers: { 'X-Secret': 'js-second' } } }] } })
  assert.deepEqual(await fetch(sb, ['pypi.test', 443, 'pypi.test', null, null, true]), ['js-second'])
  await sb.updateNetwork({ allowOut: ['pypi.test'], denyOut: ['0.0.0.0/0'] })
  assert.deepEqual(await fetch(sb, ['pypi.test', 80, 'pypi.test']), ['from-sandbox'])

  // a rule that would inject a framing header is refused, and nothing is made
  await assert.rejects(Sandbox.create(template, {
    network: { allowOut: ['pypi.test'], rules: { 'pypi.test': [{ transform: { headers: { Host: 'x' } } }] } },
  }), /cannot be set/)
  // what allowOut does not name stays closed, header rules or not
  assert.match((await fetch(sb, [otherIp, 80, 'other.test']))[0], /^FAIL/)
} catch (e) {
  console.log(`FAILED network: ${e?.stack ?? e}`)
  process.exitCode = 1
} finally {
  for (const m of made) await m.kill()
}
if (!process.exitCode) console.log('ok network')
