--[[
Stagehand's burst buffer for Slurm (burst_buffer/lua): a job waits, pending, until the datasets it
names are on the tier it asks for, and runs with their paths in its environment.

A job asks with directive lines in the leading comment block of its batch script:

  #BB_LUA stage dataset=D version=V tier=T [project=P] [name=NAME] [form=raw|prepared] [deadline=DURATION] [hold=DURATION]

  D         dataset name, 1-128 characters of [A-Za-z0-9._-], not starting with '.'
  V         version digest, or a unique prefix of it of at least 12 lowercase hex characters
  T         tier name ([a-z0-9_-], e.g. hot); a tier listed in STAGEHAND_LOCAL_TIERS is
            node-local and staged per node by stagehand-node.sh (Prolog), after this script has
            staged the version to STAGEHAND_HOT_TIER
  P         project (tenant), [a-z0-9_-]; default STAGEHAND_PROJECT of stagehand-slurm.conf
  NAME      the job finds the data at $STAGEHAND_DATA_<NAME> ([A-Za-z0-9_]); default the
            dataset name upper-cased, every other character turned into '_'
  DURATION  deadline: how long the promoter may take, e.g. 90s, 30m, 2h, 1d (default: promotion
            policy); hold: how long the staged data is held at most if the job never releases it
            (a job lost with slurmctld's state, a teardown that failed), counted from the stage
            request — default on 23.02+ the job's time limit plus STAGEHAND_HOLD_SLACK seconds
            (the time it may still queue); on 22.05 (no job_info) held until released

The hooks (facts: ../../shared/SCHEDULERS.md, "Slurm burst_buffer/lua"):

  slurm_bb_job_process  at submit, inside slurmctld: checks every directive (no I/O but the
                        script); a bad one refuses the job and sbatch prints the reason
  slurm_bb_data_in      asks Stagehand (`stagehand stage request`) for each staged version; on
                        22.05 it then waits (`stagehand stage wait`) bounded by
                        STAGEHAND_STAGE_TIMEOUT (<= StageInTimeout); on 24.05+ it only asks
  slurm_bb_test_data_in 24.05+: looks once (`stage wait --timeout 0`); BUSY until ready
  slurm_bb_paths        inside slurmctld: copies the paths data_in recorded into the job's
                        environment (STAGEHAND_DATA_<NAME>=<path>); no network
  slurm_bb_job_teardown `stagehand stage release` for each staged version, unless the job is
                        pending again (slurmctld restarted during stage-in: it tears down and
                        stages in again later, and the job still needs its data)
  the others            nothing to do; defined because 24.05 refuses to start without them

A failed or timed-out stage returns slurm.ERROR with Stagehand's reason: Slurm holds the job
(priority 0) and squeue's REASON shows "burst_buffer/lua: slurm_bb_data_in: stagehand: ...".

Every hook is idempotent: slurmctld re-runs them after a restart. Request and release ids are
derived from (project, job, dataset, version, tier[, node]) by the CLI, so a repeated request is
the same request; the recorded paths are rewritten whole (temp file, rename).

Settings come from stagehand-slurm.conf beside this script (KEY=VALUE lines, shared with
stagehand-node.sh); see that file for each key.
--]]

local script_dir = (debug.getinfo(1, "S").source:match("^@(.*)/[^/]*$")) or "."

--- Settings -----------------------------------------------------------------------------------

local defaults = {
	STAGEHAND_BIN = "stagehand",
	STAGEHAND_NATS_URL = "nats://127.0.0.1:4222",
	STAGEHAND_NATS_CREDS = "",
	STAGEHAND_PROJECT = "",
	STAGEHAND_JOB_PREFIX = "slurm-",
	STAGEHAND_STATE_DIR = "/run/stagehand-slurm",
	STAGEHAND_CONNECT_TIMEOUT = "10",
	STAGEHAND_STAGE_TIMEOUT = "3600",
	STAGEHAND_HOT_TIER = "hot",
	STAGEHAND_LOCAL_TIERS = "local",
	STAGEHAND_HOLD_SLACK = "86400",
}

-- Reads KEY=VALUE lines (comments and blank lines skipped) over the defaults. Read at every hook
-- call: an edit takes effect without restarting slurmctld.
local function load_settings()
	local conf = {}
	for k, v in pairs(defaults) do
		conf[k] = v
	end
	local path = script_dir .. "/stagehand-slurm.conf"
	local f = io.open(path, "r")
	if f then
		for line in f:lines() do
			local k, v = line:match("^%s*([A-Z_][A-Z0-9_]*)=(.-)%s*$")
			if k then
				conf[k] = v
			end
		end
		f:close()
	end
	return conf
end

local function is_local_tier(conf, tier)
	for t in conf.STAGEHAND_LOCAL_TIERS:gmatch("[^%s,]+") do
		if t == tier then
			return true
		end
	end
	return false
end

--- Directives -----------------------------------------------------------------------------------

local KEYS = { dataset = true, version = true, tier = true, project = true, name = true, form = true, deadline = true, hold = true }

local function valid_dataset(s)
	return #s >= 1 and #s <= 128 and s:sub(1, 1) ~= "." and s:match("^[A-Za-z0-9._-]+$") ~= nil
end

local function valid_token(s)
	return #s >= 1 and #s <= 64 and s:match("^[a-z0-9_-]+$") ~= nil
end

local function valid_version(s)
	return #s >= 12 and #s <= 64 and s:match("^[0-9a-f]+$") ~= nil
end

-- A duration as `stagehand` flags take it (services/config/README.md): a whole number and one
-- of ms, s, m, h, d, w, or a bare number of seconds.
local function valid_duration(s)
	return s:match("^[0-9]+[smhdw]?$") ~= nil or s:match("^[0-9]+ms$") ~= nil
end

local function default_name(dataset)
	return (dataset:upper():gsub("[^A-Z0-9]", "_"))
end

-- The directives of a job script: a list of { line, dataset, version, tier, project, name, form,
-- deadline, local_tier }, or nil and a message naming the line and what is wrong.
local function parse_directives(conf, script_path)
	local f, err = io.open(script_path, "r")
	if not f then
		return nil, "cannot read the job script: " .. tostring(err)
	end
	local directives, names, lineno = {}, {}, 0
	for line in f:lines() do
		lineno = lineno + 1
		-- Directives live in the leading comment block, like #SBATCH lines.
		if not (line:match("^%s*$") or line:match("^#")) then
			break
		end
		local rest = line:match("^#BB_LUA%s*(.*)$")
		if rest then
			local where = "line " .. lineno .. " (" .. line .. ")"
			local words = {}
			for w in rest:gmatch("%S+") do
				words[#words + 1] = w
			end
			if words[1] ~= "stage" then
				f:close()
				return nil, where .. ": a #BB_LUA line must start with 'stage'"
			end
			local d = { line = lineno }
			for i = 2, #words do
				local k, v = words[i]:match("^([a-z]+)=(.*)$")
				if not k then
					f:close()
					return nil, where .. ": '" .. words[i] .. "' is not key=value"
				end
				if not KEYS[k] then
					f:close()
					return nil, where .. ": unknown key '" .. k
						.. "' (known: dataset, version, tier, project, name, form, deadline, hold)"
				end
				if d[k] then
					f:close()
					return nil, where .. ": '" .. k .. "' given twice"
				end
				d[k] = v
			end
			local problem
			d.project = d.project or (conf.STAGEHAND_PROJECT ~= "" and conf.STAGEHAND_PROJECT or nil)
			if not d.dataset then
				problem = "dataset= is missing"
			elseif not valid_dataset(d.dataset) then
				problem = "dataset '" .. d.dataset .. "' must be 1-128 characters of [A-Za-z0-9._-], not starting with '.'"
			elseif not d.version then
				problem = "version= is missing"
			elseif not valid_version(d.version) then
				problem = "version '" .. d.version .. "' must be a digest or a prefix of at least 12 lowercase hex characters"
			elseif not d.tier then
				problem = "tier= is missing"
			elseif not valid_token(d.tier) then
				problem = "tier '" .. d.tier .. "' must be 1-64 characters of [a-z0-9_-]"
			elseif not d.project then
				problem = "project= is missing and stagehand-slurm.conf sets no STAGEHAND_PROJECT"
			elseif not valid_token(d.project) then
				problem = "project '" .. d.project .. "' must be 1-64 characters of [a-z0-9_-]"
			elseif d.form and d.form ~= "raw" and d.form ~= "prepared" then
				problem = "form '" .. d.form .. "' must be raw or prepared"
			elseif d.deadline and not valid_duration(d.deadline) then
				problem = "deadline '" .. d.deadline .. "' must be a duration such as 90s, 30m, 2h, 1d or 2w"
			elseif d.hold and not valid_duration(d.hold) then
				problem = "hold '" .. d.hold .. "' must be a duration such as 90s, 30m, 2h, 1d or 2w"
			elseif d.name and not d.name:match("^[A-Za-z0-9_]+$") then
				problem = "name '" .. d.name .. "' must be letters, digits and '_'"
			end
			if problem then
				f:close()
				return nil, where .. ": " .. problem
			end
			d.name = d.name or default_name(d.dataset)
			if names[d.name] then
				f:close()
				return nil, where .. ": STAGEHAND_DATA_" .. d.name .. " is already named by line " .. names[d.name]
					.. " (give one of them name=...)"
			end
			names[d.name] = lineno
			d.local_tier = is_local_tier(conf, d.tier)
			directives[#directives + 1] = d
		end
	end
	f:close()
	return directives
end

-- The shared-tier stages data_in makes for the directives: each directive's own tier, or for a
-- node-local directive the hot tier it is copied from (so an unknown or rejected version holds
-- the job before nodes are chosen, and the node copies from a tier already holding it).
local function shared_stages(conf, directives)
	local stages = {}
	for _, d in ipairs(directives) do
		local tier = d.local_tier and conf.STAGEHAND_HOT_TIER or d.tier
		stages[#stages + 1] = {
			dataset = d.dataset,
			version = d.version,
			project = d.project,
			form = d.form,
			deadline = d.deadline,
			hold = d.hold,
			tier = tier,
			name = d.name,
			exported = not d.local_tier,
		}
	end
	return stages
end

--- Calling the CLI ------------------------------------------------------------------------------

local function quote(s)
	return "'" .. tostring(s):gsub("'", "'\\''") .. "'"
end

local function first_line(s)
	return (s:match("^%s*([^\n]*[^%s])") or "")
end

-- Runs `stagehand <args>`; returns its exit code, stdout and stderr.
local function stagehand(conf, args)
	local err_file = os.tmpname()
	local parts = { "env" }
	if conf.STAGEHAND_NATS_CREDS ~= "" then
		parts[#parts + 1] = "STAGEHAND_NATS_CREDS=" .. quote(conf.STAGEHAND_NATS_CREDS)
	end
	parts[#parts + 1] = quote(conf.STAGEHAND_BIN)
	parts[#parts + 1] = "--nats " .. quote(conf.STAGEHAND_NATS_URL)
	parts[#parts + 1] = "--connect-timeout " .. quote(conf.STAGEHAND_CONNECT_TIMEOUT)
	for _, a in ipairs(args) do
		parts[#parts + 1] = quote(a)
	end
	local cmd = table.concat(parts, " ") .. " 2>" .. quote(err_file) .. "; echo \"stagehand-exit=$?\""
	local p = io.popen(cmd, "r")
	local out = p:read("*a")
	p:close()
	local code = tonumber(out:match("stagehand%-exit=(%d+)%s*$")) or 127
	out = out:gsub("stagehand%-exit=%d+%s*$", "")
	local ef = io.open(err_file, "r")
	local err = ef and ef:read("*a") or ""
	if ef then
		ef:close()
	end
	os.remove(err_file)
	return code, out, err
end

-- `run` is the job id Stagehand sees for this run of the Slurm job ([`run_of`]).
local function stage_args(verb, run, s)
	local args = {
		"stage", verb, s.dataset .. "@" .. s.version,
		"--tier", s.tier,
		"--job", run,
		"--project", s.project,
	}
	return args
end

local function describe(s)
	return s.dataset .. "@" .. s.version .. " on " .. s.tier
end

-- The CLI's exit code for "NATS (or the stages bucket) could not be reached in time".
local EX_UNAVAILABLE = 69

-- Between two attempts at an unreachable NATS: at least a second (an attempt that fails at
-- once, such as a missing bucket, must not spin).
local function pace(started)
	if os.time() - started < 1 then
		os.execute("sleep 1")
	end
end

-- The hold of a job's stages when its directive gives none: the job's time limit (job_info,
-- 23.02+, in minutes) plus STAGEHAND_HOLD_SLACK seconds for the time it may still queue after
-- stage-in, as a duration for `--hold-until`; nil when unknown (22.05, or no limit: Slurm's
-- INFINITE and NO_VAL are 0xfffffffe and 0xffffffff), which holds until released.
local function job_hold(conf, job_info)
	local limit = type(job_info) == "table" and tonumber(job_info.time_limit) or nil
	if not limit or limit <= 0 or limit >= 0xfffffffe then
		return nil
	end
	local slack = tonumber(conf.STAGEHAND_HOLD_SLACK) or 86400
	return tostring(math.floor(limit * 60 + slack)) .. "s"
end

-- Asks for every stage; nil on success, else a message. An unreachable NATS is asked again
-- (each attempt waits STAGEHAND_CONNECT_TIMEOUT) until `budget` seconds have passed, so a short
-- outage delays jobs instead of holding them.
local function request_all(conf, run, stages, requested_by, budget, default_hold)
	local deadline = os.time() + (budget or 0)
	for _, s in ipairs(stages) do
		local args = stage_args("request", run, s)
		if s.form then
			args[#args + 1] = "--form"
			args[#args + 1] = s.form
		end
		if s.deadline then
			args[#args + 1] = "--deadline"
			args[#args + 1] = s.deadline
		end
		local hold = s.hold or default_hold
		if hold then
			args[#args + 1] = "--hold-until"
			args[#args + 1] = hold
		end
		args[#args + 1] = "--by"
		args[#args + 1] = requested_by
		local attempt = os.time()
		local code, out, err = stagehand(conf, args)
		while code == EX_UNAVAILABLE and os.time() < deadline do
			pace(attempt)
			attempt = os.time()
			code, out, err = stagehand(conf, args)
		end
		if code ~= 0 then
			return "stagehand: requesting " .. describe(s) .. ": " .. first_line(err ~= "" and err or out)
		end
	end
	return nil
end

-- Looks at (timeout 0) or waits for (timeout > 0) one stage. Returns "ready", path; "failed",
-- reason; "waiting", last state; "unreachable", message; or "error", message.
local function wait_one(conf, run, s, timeout)
	local args = stage_args("wait", run, s)
	args[#args + 1] = "--timeout"
	args[#args + 1] = tostring(timeout)
	local code, out, err = stagehand(conf, args)
	if code == 0 then
		return "ready", first_line(out)
	elseif code == 1 then
		return "failed", first_line(out)
	elseif code == 2 then
		return "waiting", first_line(out)
	elseif code == EX_UNAVAILABLE then
		return "unreachable", first_line(err)
	end
	return "error", first_line(err ~= "" and err or out)
end

--- Which run of the job -----------------------------------------------------------------------

-- slurmctld's view of the job: { state = "PENDING", restarts = 0 }, "gone" when it no longer
-- knows the job, or nil and a message when it cannot be asked.
local function job_record(job_id)
	local p = io.popen("scontrol -o show job " .. quote(job_id) .. " 2>&1; echo \"scontrol-exit=$?\"", "r")
	local out = p:read("*a")
	p:close()
	local state = out:match("JobState=(%S+)")
	if state then
		return { state = state, restarts = tonumber(out:match("Restarts=(%d+)")) or 0 }
	end
	if out:match("Invalid job id") then
		return "gone"
	end
	return nil, first_line(out)
end

-- The job id Stagehand sees for one run of a Slurm job: the prefix and Slurm's id, and ".rN"
-- once the job was requeued N times. A requeued job stages afresh (its earlier run's stages
-- were released, and a release is final); a hook that runs twice in one run asks the same
-- request.
local function run_of(conf, job_id, restarts)
	local run = conf.STAGEHAND_JOB_PREFIX .. job_id
	if restarts and restarts > 0 then
		run = run .. ".r" .. restarts
	end
	return run
end

local function run_file(conf, job_id)
	return conf.STAGEHAND_STATE_DIR .. "/" .. job_id .. ".run"
end

-- The run data_in asked for, as it recorded it (teardown releases exactly that).
local function recorded_run(conf, job_id)
	local f = io.open(run_file(conf, job_id), "r")
	if not f then
		return nil
	end
	local run = f:read("*l")
	f:close()
	return run
end

--- The paths data_in found, for slurm_bb_paths -------------------------------------------------

local function env_file(conf, job_id)
	return conf.STAGEHAND_STATE_DIR .. "/" .. job_id .. ".env"
end

-- Writes `lines` to `path` whole (temp file, rename); nil, or a message.
local function write_whole(conf, path, lines)
	os.execute("mkdir -p " .. quote(conf.STAGEHAND_STATE_DIR))
	local tmp = path .. ".tmp"
	local f, err = io.open(tmp, "w")
	if not f then
		return "stagehand: cannot record the paths in " .. tmp .. ": " .. tostring(err)
	end
	for _, l in ipairs(lines) do
		f:write(l, "\n")
	end
	f:close()
	local ok, rerr = os.rename(tmp, path)
	if not ok then
		return "stagehand: cannot record the paths in " .. path .. ": " .. tostring(rerr)
	end
	return nil
end

local function write_env(conf, job_id, lines)
	return write_whole(conf, env_file(conf, job_id), lines)
end

local function requested_by(uid)
	if uid then
		return "slurm-uid-" .. tostring(uid)
	end
	return "slurm"
end

-- Waits for every stage until ready, bounded by `budget` seconds in all (0: look once).
-- Returns "ready", env lines; "failed"/"error", message; or "waiting", message.
local function collect(conf, run, stages, budget)
	local lines = {}
	local deadline = os.time() + budget
	for _, s in ipairs(stages) do
		local left = budget > 0 and math.max(deadline - os.time(), 1) or 0
		local attempt = os.time()
		local state, detail = wait_one(conf, run, s, left)
		-- NATS away for a while: ask again while the budget lasts.
		while state == "unreachable" and os.time() < deadline do
			pace(attempt)
			attempt = os.time()
			state, detail = wait_one(conf, run, s, math.max(deadline - os.time(), 1))
		end
		if state == "ready" then
			if s.exported then
				lines[#lines + 1] = "STAGEHAND_DATA_" .. s.name .. "=" .. detail
			end
		elseif state == "failed" then
			return "failed", "stagehand: " .. describe(s) .. " failed: " .. detail
		elseif state == "waiting" then
			return "waiting", "stagehand: " .. describe(s) .. " not ready after " .. budget .. " s: " .. detail
		elseif state == "unreachable" then
			return "unreachable", "stagehand: waiting for " .. describe(s) .. ": " .. detail
		else
			return "error", "stagehand: waiting for " .. describe(s) .. ": " .. detail
		end
	end
	return "ready", lines
end

--- The hooks ------------------------------------------------------------------------------------

-- 24.05+ polls test_data_in; 22.05 never calls it, so its data_in must wait itself.
local polled = slurm.SLURM_BB_BUSY ~= nil

function slurm_bb_job_process(job_script, uid, gid, job_info)
	local conf = load_settings()
	local directives, err = parse_directives(conf, job_script)
	if not directives then
		return slurm.ERROR, "stagehand: " .. err
	end
	return slurm.SUCCESS
end

function slurm_bb_pools()
	return slurm.SUCCESS
end

function slurm_bb_setup(job_id, uid, gid, pool, bb_size, job_script, job_info)
	return slurm.SUCCESS
end

function slurm_bb_data_in(job_id, job_script, uid, gid, job_info)
	local conf = load_settings()
	local directives, err = parse_directives(conf, job_script)
	if not directives then
		return slurm.ERROR, "stagehand: " .. err
	end
	local stages = shared_stages(conf, directives)
	local record = job_record(job_id)
	local run = run_of(conf, job_id, type(record) == "table" and record.restarts or 0)
	local werr = write_whole(conf, run_file(conf, job_id), { run })
	if werr then
		return slurm.ERROR, werr
	end
	-- End before Slurm's own StageInTimeout would kill the hook, so the held job shows
	-- Stagehand's last word rather than a bare timeout.
	local budget = math.max((tonumber(conf.STAGEHAND_STAGE_TIMEOUT) or 3600) - 5, 1)
	local started = os.time()
	local rerr = request_all(conf, run, stages, requested_by(uid), budget, job_hold(conf, job_info))
	if rerr then
		return slurm.ERROR, rerr
	end
	if polled then
		return slurm.SUCCESS
	end
	-- 22.05: wait here.
	local state, result = collect(conf, run, stages, math.max(budget - (os.time() - started), 1))
	if state ~= "ready" then
		return slurm.ERROR, result
	end
	werr = write_env(conf, job_id, result)
	if werr then
		return slurm.ERROR, werr
	end
	slurm.log_info("stagehand: job %s: data staged", job_id)
	return slurm.SUCCESS
end

function slurm_bb_test_data_in(job_id, job_script, uid, gid, job_info)
	local conf = load_settings()
	local directives, err = parse_directives(conf, job_script)
	if not directives then
		return slurm.ERROR, "stagehand: " .. err
	end
	local run = recorded_run(conf, job_id) or run_of(conf, job_id, 0)
	local state, result = collect(conf, run, shared_stages(conf, directives), 0)
	-- Not ready yet, or NATS away for now: poll again (StageInTimeout bounds the whole wait).
	if state == "waiting" or state == "unreachable" then
		return slurm.SUCCESS, slurm.SLURM_BB_BUSY
	elseif state ~= "ready" then
		return slurm.ERROR, result
	end
	local werr = write_env(conf, job_id, result)
	if werr then
		return slurm.ERROR, werr
	end
	return slurm.SUCCESS
end

function slurm_bb_real_size(job_id, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_paths(job_id, job_script, path_file, uid, gid, job_info)
	local conf = load_settings()
	local src = io.open(env_file(conf, job_id), "r")
	if not src then
		-- A job whose directives are all node-local has no shared paths to export.
		return slurm.SUCCESS
	end
	local contents = src:read("*a")
	src:close()
	local dst, err = io.open(path_file, "a")
	if not dst then
		return slurm.ERROR, "stagehand: cannot write " .. path_file .. ": " .. tostring(err)
	end
	dst:write(contents)
	dst:close()
	return slurm.SUCCESS
end

function slurm_bb_pre_run(job_id, job_script, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_post_run(job_id, job_script, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_data_out(job_id, job_script, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_test_data_out(job_id, job_script, uid, gid, job_info)
	return slurm.SUCCESS
end

function slurm_bb_job_teardown(job_id, job_script, hurry, uid, gid)
	local conf = load_settings()
	local record, serr = job_record(job_id)
	if not record then
		-- Slurm retries a failed teardown; better than releasing data a job may still need.
		return slurm.ERROR, "stagehand: cannot tell whether job " .. job_id .. " still needs its data: " .. serr
	end
	local asked = recorded_run(conf, job_id)
	-- slurmctld restarted during stage-in: it tears the buffer down and stages the same run in
	-- again later. That run still needs its data, so its stages stay (a release is final, and
	-- the request asked again is the same request).
	if type(record) == "table" and record.state == "PENDING"
		and (asked == nil or asked == run_of(conf, job_id, record.restarts)) then
		slurm.log_info("stagehand: job %s pending again (slurmctld restarted during stage-in): its stages stay", job_id)
		os.remove(env_file(conf, job_id))
		return slurm.SUCCESS
	end
	local run = asked or run_of(conf, job_id, type(record) == "table" and record.restarts or 0)
	local directives, err = parse_directives(conf, job_script)
	if not directives then
		-- Refused at submit or unreadable now: nothing was requested that we can name.
		slurm.log_info("stagehand: job %s teardown: %s", job_id, err)
		os.remove(env_file(conf, job_id))
		os.remove(run_file(conf, job_id))
		return slurm.SUCCESS
	end
	for _, s in ipairs(shared_stages(conf, directives)) do
		local code, out, rerr = stagehand(conf, stage_args("release", run, s))
		if code ~= 0 then
			-- Slurm retries a failed teardown; the release id is the same each time.
			return slurm.ERROR, "stagehand: releasing " .. describe(s) .. ": " .. first_line(rerr ~= "" and rerr or out)
		end
	end
	os.remove(env_file(conf, job_id))
	os.remove(run_file(conf, job_id))
	return slurm.SUCCESS
end

function slurm_bb_get_status(...)
	-- `scontrol show bbstat [JOB | D@V]`: Stagehand's view of the stages. 23.02+ passes uid
	-- and gid before the words typed after "bbstat".
	local args = { ... }
	local first = 1
	if #args >= 2 and tostring(args[1]):match("^%d+$") and tostring(args[2]):match("^%d+$") then
		first = 3
	end
	local conf = load_settings()
	local query = { "stage", "status" }
	for i = first, #args do
		query[#query + 1] = tostring(args[i])
	end
	local code, out, err = stagehand(conf, query)
	if code ~= 0 then
		return slurm.ERROR, first_line(err ~= "" and err or out)
	end
	return slurm.SUCCESS, out
end
